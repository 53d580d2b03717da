"""Tasks besides next-token prediction, on the same trunk and the same Trainer.

``build_task(cfg)`` returns None for the language model (the Trainer's own code path,
unchanged) or a task object that supplies the data dimensions, the model, the loader,
the loss and the evaluation (distlm/tasks/classify/task.py). ``task_model(cfg)`` is the
module ``distlm.train.setup.build_model`` puts on the meta device in place of a GPT.
"""
from __future__ import annotations


def build_task(cfg):
    if cfg.task.name == "classify":
        from distlm.tasks.classify.task import ClassifyTask
        return ClassifyTask(cfg)
    return None


def task_model(cfg):
    if cfg.task.name == "classify":
        from distlm.tasks.classify.task import classifier_for
        return classifier_for(cfg)
    raise ValueError(f"task.name={cfg.task.name} has no model of its own")
