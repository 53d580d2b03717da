"""What is trained on the trunk: next-token prediction (lm.py) or text classification
(classify/). Each is a ``Task`` (base.py) that the one Trainer asks for its data, model,
loss and evaluation."""
from distlm.tasks.base import Resolved, Task, build_task

__all__ = ["Resolved", "Task", "build_task"]
