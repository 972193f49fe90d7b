"""Evaluation tasks: deterministic instance generators plus scorers.

>>> task = get_task("add")
>>> inst = task.instances(1, seed=0, split="eval")[0]
>>> task.score(inst, inst.reference)
1.0

Registry names: ``add``, ``sort``, ``sudoku``, ``humaneval``, and
three tasks with many correct, strongly coupled answers: ``tiesort``, ``either`` and ``pick`` (see :data:`TASKS`). Every task's
train and eval splits are disjoint by construction (see :mod:`dlm_toolkit.tasks.base`). Chance
level (random guessing) is ~0 for all of them; :meth:`Task.chance_score` measures it.
"""

from __future__ import annotations

from typing import Any

from .add import AddTask
from .base import Instance, Split, Task, split_of
from .either import EitherTask
from .humaneval import HumanEvalTask
from .pick import PickTask
from .sort import SortTask
from .sudoku import SudokuTask
from .tiesort import TieSortTask

__all__ = [
    "TASKS",
    "AddTask",
    "EitherTask",
    "PickTask",
    "HumanEvalTask",
    "Instance",
    "SortTask",
    "Split",
    "SudokuTask",
    "Task",
    "TieSortTask",
    "get_task",
    "split_of",
]

TASKS: dict[str, type[Task]] = {
    cls.name: cls for cls in (AddTask, SortTask, SudokuTask, HumanEvalTask, TieSortTask, EitherTask, PickTask)
}
"""Task name -> task class."""


def get_task(name: str, **kwargs: Any) -> Task:
    """Instantiate the task registered as ``name`` with constructor ``kwargs``.

    Raises:
        ValueError: for an unknown name; the message lists the available names.
    """
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; available tasks: {', '.join(sorted(TASKS))}"
        ) from None
    return cls(**kwargs)
