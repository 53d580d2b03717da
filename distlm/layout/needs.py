"""What each task asks of the axes that would split its model, declared once per task.

The axes refuse a task by what it needs, never by its name: an axis that cuts the rows
(``Axis.splits_sequence``) refuses a task whose head reads every position of a row on one
rank; one whose plans are written for the language model's head (``Axis.plans_for_lm_head``:
TP's vocabulary-parallel head and loss, PP's stages ending in the head's loss) refuses a task
without that head.

The declarations sit here, beside the axes, rather than in distlm/tasks/: the config is
validated (``check_layout``, inside ``load_config``) below the tasks' floor and before torch
is imported, which every task module does. Each task class carries its entry as ``needs``
(``LMTask.needs is TASKS["lm"]``), so what a task needs is read in one place either way.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskNeeds:
    whole_rows: bool = False
    # ^ its head reads every position of a row on one rank (a pooled classifier): no axis may
    #   cut the rows
    lm_head: bool = True
    # ^ its model is the GPT ending in the language model's head, which tensor and pipeline
    #   parallelism are written for


# task.name -> what it needs (the config's TaskConfig.name lists the same names)
TASKS: dict[str, TaskNeeds] = {
    "lm": TaskNeeds(),
    # its pooling reads whole rows, and its trunk and pooled head are not the GPT's blocks and
    # LM head that TP's plans and PP's stages are written for
    "classify": TaskNeeds(whole_rows=True, lm_head=False),
}


def needs_of(cfg) -> TaskNeeds:
    return TASKS[cfg.task.name]
