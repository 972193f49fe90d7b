"""Experiment files: what a sweep evaluates, what it searches and how it scores a trial.

An experiment is a YAML file (see ``experiments/README.md`` for a walk-through)::

    name: quickstart                      # default study name (default: the file's stem)
    model: ../checkpoints/testbed-editable  # relative paths: against THIS FILE's folder
    task: add                             # dlm_toolkit.tasks name; task_args: {...} for its constructor
                                          # (benchmarks: {data: PATH, chat: auto, answer_length: 256})
    n: 48                                 # eval instances per trial (seeded by `seed`)
    seed: 0
    batch_size: 16                        # results do not depend on it; pruning acts per batch
    base_policy: llada2.1-q               # preset name, policy file, or an inline policy dict
    search_space:                         # flat config keys, as in `--set`
      m2t.params.threshold: {float: [0.3, 0.99]}          # optional: log: true, step: 0.05
      t2t.name: {categorical: [none, threshold]}
      t2t.params.threshold: {float: [0.0, 0.95], when: {t2t.name: threshold}}
      blocks.params.block_length: {categorical: [8, 16, 32]}
    objectives: {accuracy: maximize, tpf: maximize}       # the default
    sampler: nsga2                        # or {name: tpe, seed: 0, options: {...}}; random; grid
    pruning: {rule: threshold, min_quality: 0.05, after: 16}   # default: {rule: none}
    presets_to_enqueue: [llada2.1-s, llada2.1-q]          # the default
    n_trials: 24                          # default for `dlm sweep --n-trials`
    threads: 1                            # torch threads per worker (default: torch's choice)
    cuda_graphs: null                     # CUDA-graph forwards: null = on for CUDA (the default), true, false
    mlflow_experiment: dlm-sweep          # the default

Paths: ``model``, ``task_args.data`` (a benchmark's data file or folder), a ``base_policy`` file
and preset files are resolved against the folder of the YAML file (an experiment built from a dict resolves them against ``base_dir``, by default
the current folder), and stored as absolute paths in the study.

Everything is checked by :func:`load_experiment` before any trial runs; every problem is a
:class:`~dlm_toolkit.config.ConfigError` naming the key, the value and what is allowed.
Checks that need the outside world (checkpoint, storage, tracking store) are in
:func:`dlm_toolkit.sweep.study.check_resources`.

Search-space semantics:

* ``ROLE.name`` must be ``categorical`` over registered rule names (or ``package.module:Class``).
  When a trial picks the base policy's rule, the base policy's params for that role are kept;
  when it picks another rule, that rule starts from its defaults (as ``--set ROLE.name=X``).
* ``ROLE.params.FIELD`` must exist in every rule it can be combined with: the base policy's
  rule, or each choice of the space's ``ROLE.name`` (narrowed by ``when: {ROLE.name: ...}``).
* ``float``/``int`` ranges must lie inside the field's allowed range; categorical values must
  each be valid for the field.
* ``when: {KEY: VALUE or [VALUES]}``: the key is only sampled in trials where every listed
  ``KEY`` (a categorical key of the same space) took one of the listed values.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any, Literal, Mapping, Union

from pydantic import Field, PrivateAttr, field_validator, model_validator

from dlm_toolkit.config import ConfigError, read_mapping_file, validate_model
from dlm_toolkit.strategy.policy_config import PolicyConfig, load_policy
from dlm_toolkit.strategy.registry import allow_imports, imports_allowed
from dlm_toolkit.sweep.space import (  # noqa: F401  (re-exported: the search space lives in space.py)
    MAX_GRID_POINTS,
    MAX_GRID_VALUES,
    ParamSpec,
    _Frozen,
    check_conditions,
    check_key,
)

METRICS = (
    "accuracy",
    "tpf",
    "nfe_mean",
    "tokens_per_second",
    "edits_per_token",
    "remasks_per_token",
    "forward_tokens_per_token",
    "inserts_per_token",
    "deletes_per_token",
    "wall_time_s",
)
"""Metrics of :func:`dlm_toolkit.evaluation.evaluate.evaluate` that can be objectives."""

SAMPLERS = ("nsga2", "tpe", "random", "grid")
DEFAULT_OBJECTIVES = {"accuracy": "maximize", "tpf": "maximize"}
DEFAULT_PRESETS = ("llada2.1-s", "llada2.1-q")
DEFAULT_NSGA2_POPULATION = 10  # Optuna's 50 would make a 50-trial sweep one random generation

class SamplerSpec(_Frozen):
    """``nsga2`` (default), ``tpe``, ``random`` or ``grid``; ``seed``; constructor ``options``.

    A string is accepted as shorthand for ``{name: ...}``. With several workers, worker ``k``
    uses ``seed + k`` so the workers do not propose the same points.
    """

    name: Literal["nsga2", "tpe", "random", "grid"] = "nsga2"
    seed: int | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class Pruning(_Frozen):
    """Stopping unpromising trials early, on the running accuracy after each evaluated batch.

    * ``none`` (default).
    * ``threshold``: stop a trial whose running accuracy is below ``min_quality`` once at
      least ``after`` instances are done. Works with any number of objectives.
    * ``median``: Optuna's ``MedianPruner`` on the running value of the single objective
      (``n_startup_trials`` complete trials first, ``after`` = warm-up instances). Optuna does
      not support pruning multi-objective studies, so ``median`` needs exactly one objective.

    Pruned trials count toward ``n_trials`` and never enter the Pareto front. Preset trials
    are never pruned (they are the reference points of the front).
    """

    rule: Literal["none", "threshold", "median"] = "none"
    min_quality: float | None = Field(None, ge=0.0, le=1.0)
    after: int = Field(1, ge=1)
    n_startup_trials: int = Field(5, ge=0)

    @model_validator(mode="after")
    def _needs(self) -> Pruning:
        if self.rule == "threshold" and self.min_quality is None:
            raise ValueError("pruning: rule 'threshold' needs min_quality (stop a trial whose running "
                             "accuracy is below it after `after` instances)")
        if self.rule != "threshold" and self.min_quality is not None:
            raise ValueError(f"pruning: min_quality only applies to rule 'threshold' (rule is {self.rule!r})")
        return self


class Experiment(_Frozen):
    """A validated sweep experiment; build it with :func:`load_experiment`."""

    name: str | None = None
    model: str
    task: str
    task_args: dict[str, Any] = Field(default_factory=dict)
    n: int = Field(64, ge=1)
    seed: int = 0
    batch_size: int = Field(32, ge=1)
    base_policy: Union[str, dict[str, Any]] = "llada2.1-q"
    search_space: dict[str, ParamSpec]
    objectives: dict[str, Literal["maximize", "minimize"]] = Field(default_factory=lambda: dict(DEFAULT_OBJECTIVES))
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruning: Pruning = Field(default_factory=Pruning)
    presets_to_enqueue: tuple[str, ...] = DEFAULT_PRESETS
    n_trials: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1)
    device: str | None = None
    dtype: str | None = None
    cuda_graphs: bool | None = None  # capture forwards in CUDA graphs; null: on for CUDA devices
    allow_import: bool = False
    mlflow_experiment: str = "dlm-sweep"

    _source: Path | None = PrivateAttr(None)

    @field_validator("mlflow_experiment")
    @classmethod
    def _experiment_name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(f"mlflow_experiment: must name an MLflow experiment (got {v!r}); leave the key out "
                             "for the default dlm-sweep")
        return v

    @field_validator("objectives")
    @classmethod
    def _objectives(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError(f"objectives: give at least one of {', '.join(METRICS)}")
        unknown = [k for k in v if k not in METRICS]
        if unknown:
            raise ValueError(f"objectives: unknown metric {unknown[0]!r}; available: {', '.join(METRICS)}")
        return v

    @field_validator("search_space")
    @classmethod
    def _space(cls, v: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
        if not v:
            raise ValueError("search_space: empty; give at least one flat key, e.g. "
                             "m2t.params.threshold: {float: [0.3, 0.99]}")
        return v

    # -- derived -------------------------------------------------------------------------------
    @property
    def source(self) -> Path | None:
        """The YAML file this experiment was read from, if any."""
        return self._source

    @property
    def default_name(self) -> str:
        return self.name or (self._source.stem if self._source else "dlm-sweep")

    @property
    def directions(self) -> list[str]:
        return list(self.objectives.values())

    @property
    def metric_names(self) -> list[str]:
        return list(self.objectives)

    def base(self) -> PolicyConfig:
        return load_policy(self.base_policy)

    def key_order(self) -> list[str]:
        """Search-space keys in an order where every ``when`` key comes before its dependants."""
        order: list[str] = []
        pending = dict(self.search_space)
        while pending:
            ready = [k for k, s in pending.items() if all(c in order for c in s.when)]
            if not ready:
                raise ConfigError(f"search_space: circular 'when' conditions among {sorted(pending)}")
            for k in ready:
                order.append(k)
                del pending[k]
        return order

    def settings(self) -> dict[str, Any]:
        """JSON-able dict of everything (stored in the study so that replay/resume can use it)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=False)

    def result_settings(self) -> dict[str, Any]:
        """The settings that decide a trial's results; a study cannot be resumed with others."""
        s = self.settings()
        return {k: s[k] for k in ("model", "task", "task_args", "n", "seed", "batch_size", "base_policy",
                                  "search_space", "objectives")}


PRIVILEGED_TASK_ARGS = {"unsafe_exec": "--unsafe-exec", "allow_import": "--allow-import"}
"""Task arguments that weaken isolation, with the command-line flag that grants each: they are
never read from an experiment file or a study store, only from the command line of the person
who runs it (``dlm sweep --unsafe-exec``, ``dlm replay --allow-import``). ``unsafe_exec``: a code
task runs generated code without bubblewrap; ``allow_import``: ``lm_eval`` reads task files from
a folder (``include_path``) or a YAML path, whose ``!function`` Python it imports unsandboxed (an
experiment's top-level ``allow_import: true`` names strategy classes only; it grants nothing here)."""

_PRIVILEGE_WHAT = {"unsafe_exec": "weakens the sandbox", "allow_import": "lets lm-eval import Python from files"}


def check_unprivileged(task_args: Any, where: str, command: str) -> None:
    """Refuse ``task_args`` that ask for a privilege (see :data:`PRIVILEGED_TASK_ARGS`).

    Raises:
        ConfigError: ``WHERE: task_args.unsafe_exec: ...; pass `COMMAND --unsafe-exec` ...``.
    """
    if not isinstance(task_args, Mapping):
        return
    for key, flag in PRIVILEGED_TASK_ARGS.items():
        if key in task_args:
            raise ConfigError(f"{where}: task_args.{key}: {_PRIVILEGE_WHAT[key]} and is only taken from the command "
                              f"line, never from a file; remove it and pass `{command} {flag}` to allow it")


def load_experiment(
    source: str | Path | Mapping[str, Any],
    overrides: Mapping[str, Any] | None = None,
    base_dir: str | Path | None = None,
    unsafe_exec: bool = False,
    allow_import: bool = False,
) -> Experiment:
    """Read, resolve and validate an experiment.

    Args:
        source: a YAML file path or an already-parsed dict.
        overrides: flat-key overrides of the base policy (``dlm sweep --set``).
        base_dir: folder for relative paths of a dict source (default: current folder).
        unsafe_exec: the command line's ``--unsafe-exec`` (a code task may run without
            bubblewrap); an experiment *file* that sets ``task_args.unsafe_exec`` is refused.
        allow_import: the command line's ``--allow-import``, passed to a task that takes it
            (``lm_eval``: task files from a folder); likewise never read from the file.

    Raises:
        ConfigError: unreadable file, unknown keys, bad values, search-space keys that do not
            exist in the policy schema, ranges outside a field's allowed range, unknown task,
            sampler or preset, ... (no trial has run yet).
    """
    path: Path | None = None
    if isinstance(source, Mapping):
        data = dict(source)
        folder = Path(base_dir or ".").resolve()
        where = "experiment"
    else:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"cannot read experiment file {path}: no such file")
        data = read_mapping_file(path)  # bounded: size limit, no YAML aliases
        folder = path.resolve().parent
        where = str(path)
        check_unprivileged(data.get("task_args"), where, "dlm sweep")
    for key, granted in (("unsafe_exec", unsafe_exec), ("allow_import", allow_import)):
        if granted and _takes(data.get("task"), key):
            data["task_args"] = {**(data.get("task_args") if isinstance(data.get("task_args"), dict) else {}),
                                 key: True}
    data = _resolve_paths(data, folder)
    with allow_imports(imports_allowed() or data.get("allow_import") is True):
        try:
            exp = validate_model(Experiment, data)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        try:
            base = load_policy(exp.base_policy, overrides or {})
        except ConfigError as err:
            raise ConfigError(f"{where}: base_policy: {err}") from None
        exp = exp.model_copy(update={"base_policy": base.model_dump(mode="json")})
        exp._source = path.resolve() if path is not None else None
        try:
            validate_experiment(exp)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    return exp


def _takes(task: Any, arg: str) -> bool:
    """Whether registered task ``task`` takes constructor argument ``arg`` (a flag that only
    code tasks use is a no-op for the others, as ``dlm eval --unsafe-exec`` is)."""
    from dlm_toolkit.tasks import TASKS

    cls = TASKS.get(task) if isinstance(task, str) else None
    return cls is not None and arg in inspect.signature(cls).parameters


def _resolve_paths(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    data = dict(data)

    def resolve(value: Any) -> Any:
        return str((folder / value).resolve()) if isinstance(value, str) and not Path(value).is_absolute() else value

    if isinstance(data.get("model"), str) and not data["model"].startswith("oracle:"):  # oracle:TASK: no path
        data["model"] = resolve(data["model"])
    if isinstance(data.get("task_args"), dict) and isinstance(data["task_args"].get("data"), str):
        data["task_args"] = {**data["task_args"], "data": resolve(data["task_args"]["data"])}
    if isinstance(data.get("base_policy"), str) and _is_file(data["base_policy"]):
        data["base_policy"] = resolve(data["base_policy"])
    if isinstance(data.get("presets_to_enqueue"), list):
        data["presets_to_enqueue"] = [resolve(p) if _is_file(p) else p for p in data["presets_to_enqueue"]]
    return data


def _is_file(name: Any) -> bool:
    return isinstance(name, str) and Path(name).suffix in (".json", ".yaml", ".yml")


# -- validation --------------------------------------------------------------------------------
def validate_experiment(exp: Experiment) -> None:
    """All checks that need nothing but the code: space, task, presets, sampler, pruning."""
    base = exp.base()
    for key in exp.search_space:
        check_conditions(exp, key)
    exp.key_order()
    for key in exp.search_space:
        check_key(exp, base, key)
    _check_task(exp)
    for preset in exp.presets_to_enqueue:
        try:
            load_policy(preset)
        except ConfigError as err:
            raise ConfigError(f"presets_to_enqueue: {err}") from None
    _check_sampler(exp)
    if exp.pruning.rule == "median" and len(exp.objectives) != 1:
        raise ConfigError(
            f"pruning: rule 'median' needs exactly one objective (got {len(exp.objectives)}: "
            f"{', '.join(exp.objectives)}); Optuna cannot prune multi-objective studies. "
            "Use {rule: threshold, min_quality: X, after: K} instead"
        )


def _check_task(exp: Experiment) -> None:
    from dlm_toolkit.tasks import get_task

    from dlm_toolkit.evaluation.evaluate import check_n

    try:
        task = get_task(exp.task, **exp.task_args)
    except ValueError as err:
        raise ConfigError(f"task: {err}") from None
    except TypeError as err:
        raise ConfigError(f"task_args: {err}") from None
    check_n(task, exp.n, split=False)  # n past the split takes all of it; a generated task is bounded


def _check_sampler(exp: Experiment) -> None:
    import optuna

    spec = exp.sampler
    cls = {"nsga2": optuna.samplers.NSGAIISampler, "tpe": optuna.samplers.TPESampler,
           "random": optuna.samplers.RandomSampler, "grid": optuna.samplers.GridSampler}[spec.name]
    params = inspect.signature(cls).parameters
    reserved = {"seed", "search_space"}
    for opt in spec.options:
        if opt not in params or opt in reserved:
            allowed = sorted(p for p in params if p not in reserved)
            raise ConfigError(f"sampler.options: unknown option {opt!r} for sampler {spec.name!r} "
                              f"(accepted: {', '.join(allowed) or 'none'})")
    for key, s in exp.search_space.items():  # sizes are computed, never enumerated, before this check
        if (s.size() or 0) > MAX_GRID_VALUES:
            raise ConfigError(f"search_space.{key}: {s.describe()} has {s.size()} values, more than "
                              f"{MAX_GRID_VALUES}: use a larger step (or none, for a continuous range)")
    if spec.name == "grid":
        for key, s in exp.search_space.items():
            if s.size() is None:
                raise ConfigError(f"sampler: grid needs a finite search space, but search_space.{key} is a "
                                  f"continuous {s.describe()}; give it a step or make it categorical")
        points = math.prod(s.size() for s in exp.search_space.values())
        if points > MAX_GRID_POINTS:
            raise ConfigError(f"sampler: the grid has {points} points, more than {MAX_GRID_POINTS}; "
                              "coarsen the steps or search fewer keys")


