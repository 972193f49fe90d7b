"""Any lm-evaluation-harness ``generate_until`` task as a task of ours (``task: lm_eval`` in an
experiment, ``dlm eval --task lm_eval``), so sweeps and ``dlm compare`` search and compare
policies on it with per-instance outcomes.

The prompts are lm-eval's own contexts (few-shot examples included), the stop strings and the
generation budget its ``generation_kwargs`` (``until``, ``max_gen_toks``), and a completion is
scored by the task's own filters and ``process_results`` (one filter and one metric: by default
the first of each). Needs the ``eval`` extra; lm-eval is imported only when such a task is built.

Options (``task_args``): ``task`` (an lm-eval task name), ``include_path`` (a folder of custom
task YAMLs; then only that folder is indexed unless ``include_defaults: true``), ``num_fewshot``,
``filter``, ``metric``.

Reading task files from a folder is a privilege: a task YAML runs Python (``!function utils.f``
imports ``utils.py`` beside it, unsandboxed, as the evaluator's user), so ``include_path`` and a
``task`` that names a YAML file need ``allow_import`` -- which only the command line grants
(``dlm eval/sweep/replay --allow-import``; an experiment file or a study store never does, see
:data:`~dlm_toolkit.sweep.experiment.PRIVILEGED_TASK_ARGS`). Without it only lm-eval's own
installed tasks load.
"""

from __future__ import annotations

import os
import random
from typing import Any

from dlm_toolkit.config import ConfigError

from .base import Instance, Split, Task
from .data import fixed_subset

__all__ = ["IMPORT_FLAG", "LmEvalTask", "check_imports"]

IMPORT_FLAG = "--allow-import"
MAX_FEWSHOT = 1000


def check_imports(task: object, include_path: object, allowed: bool) -> None:
    """Refuse, in one line naming :data:`IMPORT_FLAG`, what would make lm-eval read task files (and
    so import their ``!function`` Python) from outside its own package -- ``include_path``, or a
    ``task`` naming a YAML file -- unless ``allowed``; and a ``task`` that is not a name."""
    if not isinstance(task, str) or not task:
        raise ConfigError(f"task_args.task: must be an lm-eval task name (got {task!r})")
    if include_path is not None and not isinstance(include_path, str):
        raise ConfigError(f"task_args.include_path: must be a folder (got {include_path!r})")
    if allowed:
        return
    if include_path is not None:
        raise ConfigError(f"task_args.include_path: lm-eval would import Python from {include_path} (a task YAML's "
                          f"!function), unsandboxed; only the command line grants that: pass {IMPORT_FLAG}")
    if task.endswith((".yaml", ".yml")) or "/" in task or os.sep in task:
        raise ConfigError(f"task_args.task: {task!r} is a file: lm-eval would import Python named by it, "
                          f"unsandboxed; only the command line grants that: pass {IMPORT_FLAG}")


class LmEvalTask(Task):
    """An lm-eval ``generate_until`` task, scored by lm-eval (see the module docstring)."""

    name = "lm_eval"
    description = "an lm-evaluation-harness generate_until task (its prompts, stop strings, filters and metric)"
    metric_name = "lm-eval metric"

    def __init__(self, task: str, include_path: str | None = None, include_defaults: bool | None = None,
                 num_fewshot: int | None = None, filter: str | None = None, metric: str | None = None,
                 allow_import: bool = False) -> None:
        check_imports(task, include_path, allow_import is True)
        for option, value in (("filter", filter), ("metric", metric)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"task_args.{option}: must be a string (got {value!r})")
        if num_fewshot is not None and (type(num_fewshot) is not int or not 0 <= num_fewshot <= MAX_FEWSHOT):
            raise ConfigError(f"task_args.num_fewshot: must be an integer in [0, {MAX_FEWSHOT}] (got {num_fewshot!r})")
        if include_defaults is not None and not isinstance(include_defaults, bool):
            raise ConfigError(f"task_args.include_defaults: must be true or false (got {include_defaults!r})")
        try:
            from lm_eval.tasks import TaskManager, get_task_dict
        except ImportError as e:
            raise ConfigError(f"task lm_eval needs lm-evaluation-harness: pip install -e \".[eval]\" ({e})") from None
        defaults = include_path is None if include_defaults is None else bool(include_defaults)
        manager = TaskManager(include_path=include_path, include_defaults=defaults)
        if not allow_import and task not in manager.task_index:  # lm-eval would then try it as a file path
            raise ConfigError(f"task_args.task: lm-eval has no task {task!r}")
        try:
            found = get_task_dict([task], manager)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"task_args.task: lm-eval has no task {task!r} ({e})") from None
        obj = found.get(task)
        if obj is None or not hasattr(obj, "OUTPUT_TYPE"):
            raise ConfigError(f"task_args.task: {task!r} is an lm-eval group; name one of its tasks")
        if obj.OUTPUT_TYPE != "generate_until":
            raise ConfigError(f"task_args.task: lm-eval task {task!r} is {obj.OUTPUT_TYPE}; only generate_until "
                              "tasks can be decoded (a diffusion LM has no exact likelihood here)")
        if num_fewshot is not None:
            obj.set_config(key="num_fewshot", value=int(num_fewshot))
        obj.build_all_requests(rank=0, world_size=1)
        requests = sorted(obj.instances, key=lambda r: r.doc_id)
        if not requests:
            raise ConfigError(f"task_args.task: lm-eval task {task!r} has no documents")
        filters = {f.name: f for f in getattr(obj, "_filters", [])}
        self.filter = filter or next(iter(filters), "none")
        if self.filter not in filters:
            raise ConfigError(f"task_args.filter: {self.filter!r} is not a filter of {task!r} ({', '.join(filters)})")
        metrics = list(getattr(obj, "_metric_fn_list", {}))
        self.metric = metric or (metrics[0] if metrics else "exact_match")
        if self.metric not in metrics:
            raise ConfigError(f"task_args.metric: {self.metric!r} is not a metric of {task!r} ({', '.join(metrics)})")
        kwargs = [dict(r.args[1] or {}) for r in requests]
        untils = {tuple([k["until"]] if isinstance(k.get("until"), str) else k.get("until") or ()) for k in kwargs}
        budgets = {int(k.get("max_gen_toks", 256)) for k in kwargs}
        if len(untils) != 1 or len(budgets) != 1:
            raise ConfigError(f"task_args.task: {task!r} asks different stop strings or budgets per document")
        self.task_name, self._obj, self._ensemble = task, obj, filters[self.filter]
        self.stop = untils.pop()
        self.answer_length = budgets.pop() - 1  # evaluate() decodes answer_length + 1 positions
        self.metric_name = f"{self.metric} ({self.filter})"
        self._instances = [Instance(prompt=r.args[0], reference=str(r.doc_id), meta={"doc_id": r.doc_id, "request": r})
                           for r in requests]
        self.eval_size = len(self._instances)

    def instances(self, n: int, seed: int, split: Split) -> list[Instance]:
        return fixed_subset(self._instances, n, seed, split, f"{self.name}|{self.task_name}")

    def _sample(self, rng: random.Random, split: Split) -> Instance | None:
        return rng.choice(self._instances)

    def split_of(self, instance: Instance) -> Split:
        return "eval"

    def canonical_key(self, instance: Instance) -> str:
        return f"{self.task_name}|{instance.meta['doc_id']}"

    def score(self, instance: Instance, completion: str) -> float:
        request = instance.meta["request"]
        request.resps = [completion]
        self._ensemble.apply([request])
        result: dict[str, Any] = self._obj.process_results(request.doc, [request.filtered_resps[self.filter]])
        return float(result[self.metric])

    def chance_score(self, n: int = 500, seed: int = 0) -> float:
        return 0.0

    def __repr__(self) -> str:
        return f"LmEvalTask(task={self.task_name!r}, filter={self.filter!r}, metric={self.metric!r})"
