"""Evaluation tasks: deterministic instance generators plus scorers.

>>> task = get_task("add")
>>> inst = task.instances(1, seed=0, split="eval")[0]
>>> task.score(inst, inst.reference)
1.0

Registry names: ``add``, ``sort``, ``sudoku``, ``humaneval``,
the oracle list tasks (:mod:`dlm_toolkit.tasks.list_ops`: ``list_copy`` ... ``latin_square``),
three tasks with many correct, strongly coupled answers: ``tiesort``, ``either`` and ``pick``, and the
benchmarks read from local files (:mod:`dlm_toolkit.tasks.data`): ``gsm8k``, ``gsm_plus``, ``math500``,
``mbpp``, ``humaneval_plus``, ``mbpp_plus``, ``livecodebench``, ``bigcodebench``, and ``lm_eval`` (any lm-evaluation-harness generate_until
task; needs the ``eval`` extra) (see :data:`TASKS`). Every task's
train and eval splits are disjoint by construction (see :mod:`dlm_toolkit.tasks.base`). Chance
level (random guessing) is ~0 for all of them; :meth:`Task.chance_score` measures it.
"""

from __future__ import annotations

from typing import Any

from .add import AddTask
from .base import Instance, Split, Task, split_of
from .bigcodebench import BigCodeBenchTask
from .data import BenchmarkTask, DataError
from .either import EitherTask
from .gsm8k import GSM8KTask, GSMPlusTask
from .humaneval import HumanEvalTask
from .livecodebench import LiveCodeBenchTask
from .list_ops import LIST_TASKS
from .lm_eval_task import LmEvalTask
from .math500 import Math500Task
from .mbpp import HumanEvalPlusTask, MBPPPlusTask, MBPPTask
from .parallelbench import ParallelBenchTask
from .pick import PickTask
from .sort import SortTask
from .sudoku import SudokuTask
from .tiesort import TieSortTask

__all__ = [
    "BENCHMARKS",
    "BigCodeBenchTask",
    "TASKS",
    "AddTask",
    "BenchmarkTask",
    "DataError",
    "GSM8KTask",
    "GSMPlusTask",
    "HumanEvalPlusTask",
    "LiveCodeBenchTask",
    "LmEvalTask",
    "MBPPPlusTask",
    "MBPPTask",
    "Math500Task",
    "ParallelBenchTask",
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

BENCHMARKS: tuple[type[Task], ...] = (GSM8KTask, GSMPlusTask, Math500Task, MBPPTask, HumanEvalPlusTask, MBPPPlusTask)
"""The benchmark tasks (data read from local files)."""
BENCHMARKS += (LiveCodeBenchTask,)

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (AddTask, SortTask, SudokuTask, HumanEvalTask, TieSortTask, EitherTask, PickTask, *BENCHMARKS, LmEvalTask)
}
"""Task name -> task class."""
TASKS[BigCodeBenchTask.name] = BigCodeBenchTask
TASKS[ParallelBenchTask.name] = ParallelBenchTask
TASKS.update((cls.name, cls) for cls in LIST_TASKS)  # the oracle tasks (list_ops)

PROMPT_OPTIONS = ("chat", "system")
"""Options every task takes besides its constructor's (see :mod:`dlm_toolkit.models.chat`)."""


def get_task(name: str, **kwargs: Any) -> Task:
    """Instantiate the task registered as ``name`` with constructor ``kwargs``.

    ``chat`` (``auto``/``true``/``false``, default ``auto``) and ``system`` (a system turn) are
    accepted by every task: they say how its prompts are formatted (:mod:`dlm_toolkit.models.chat`).

    Raises:
        ValueError: for an unknown name; the message lists the available names.
    """
    from dlm_toolkit.models.chat import parse_chat_mode

    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; available tasks: {', '.join(sorted(TASKS))}"
        ) from None
    chat = parse_chat_mode(kwargs.pop("chat", "auto"), "chat")
    system = kwargs.pop("system", None)
    if system is not None and not isinstance(system, str):
        raise ValueError(f"system: must be a string (got {system!r})")
    try:
        task = cls(**kwargs)
    except TypeError as e:  # a missing or unknown constructor option
        import inspect

        from dlm_toolkit.config import ConfigError

        options = ", ".join(p for p in inspect.signature(cls).parameters)
        raise ConfigError(f"task '{name}': {e} (its options: {options}, plus chat, system)") from None
    task.chat, task.system = chat, system
    return task
