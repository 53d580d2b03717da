"""What is trained on the trunk: next-token prediction (lm.py) or text classification
(classify/). Each is a ``Task`` (base.py) that the one Trainer asks for its data, model,
loss and evaluation, showing it the run through a ``RunContext``."""
from distlm.config import Config
from distlm.tasks.base import Resolved, RunContext, Task


def build_task(cfg: Config) -> Task:
    """The task named by task.name; imported on demand (a classifier pulls in its data readers)."""
    if cfg.task.name == "classify":
        from distlm.tasks.classify.task import ClassifyTask
        return ClassifyTask()
    from distlm.tasks.lm import LMTask
    return LMTask()


__all__ = ["Resolved", "RunContext", "Task", "build_task"]
