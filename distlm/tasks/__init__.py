"""Tasks besides next-token prediction, on the same trunk and the same Trainer.

``build_task(cfg)`` returns None for the language model (the Trainer's own code path,
unchanged) or a task object that supplies the data dimensions, the model, the loader,
the loss and the evaluation (distlm/tasks/classify/task.py).
"""
from __future__ import annotations


def build_task(cfg):
    if cfg.task.name == "classify":
        from distlm.tasks.classify.task import ClassifyTask
        return ClassifyTask(cfg)
    return None
