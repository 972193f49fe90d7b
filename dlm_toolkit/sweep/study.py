"""Run an Optuna search over decoding policies: :func:`run_sweep`.

Decisions (also in ``experiments/README.md``):

* **What counts toward ``n_trials``**: the target TOTAL of *finished* trials in the study, where
  finished = COMPLETE, PRUNED, or FAIL with an ``error`` user attribute (the policy or the
  evaluation raised: rerunning would raise again). Trials whose process died (``kill -9``,
  out of memory) or was interrupted (Ctrl-C) do not count: they are retried with the same
  params. Rerunning the same command resumes and stops at ``n_trials``; it never redoes a
  finished trial. With several workers the count is exact too: a worker whose new trial would
  exceed the target (a race at the very end) marks it FAIL with the user attribute
  ``surplus`` (not counted, nothing evaluated, no MLflow run).
* **Killed trials**: the storage records a heartbeat per running trial (``heartbeat_interval``
  seconds); a trial without heartbeat for ``grace_period`` seconds is marked FAIL and, by
  Optuna's ``RetryHeartbeatStaleTrialCallback``, re-queued (WAITING, same params and user
  attributes, at most 3 retries). A resumed sweep therefore waits, at its end, until such
  trials are detected and rerun. Their MLflow runs are closed as KILLED
  (:meth:`~dlm_toolkit.sweep.tracking.Tracker.reconcile`).
* **Presets** (``presets_to_enqueue``) are enqueued once per study (study user attribute
  ``presets_enqueued`` plus a check of existing trials). A preset trial evaluates the preset
  policy itself (not base + params); its params in Optuna are the preset's values of those
  search-space keys whose value is a point of the space, so samplers learn from it.
* **Pruning**: see :class:`~dlm_toolkit.sweep.experiment.Pruning` (threshold rule for any
  number of objectives; Optuna's median pruner only for one objective).
* **Workers**: ``workers=K > 1`` runs worker 0 in the calling process (its model and stores are
  already open) and starts K - 1 subprocesses (``python -m dlm_toolkit.sweep.worker``) on the
  same study; each uses ``cpu_count // K`` torch threads unless ``threads`` is set. Worker k's
  sampler is seeded with ``seed + k``. SQLite storages get a 60 s busy timeout.

Study user attributes: ``experiment`` (all settings, JSON; a study cannot be resumed with
different result-relevant settings), ``presets_enqueued``, ``dlm_toolkit_version``.
Trial user attributes: ``policy`` (canonical JSON), ``policy_hash``, ``metrics``, ``preset`` and
``preset_policy``, ``error``, ``pruned_at``, ``mlflow_run_id``, ``worker`` (host:pid),
``interrupted``, ``surplus``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from dlm_toolkit.config import ROLES, ConfigError, PolicyConfig, load_policy
from dlm_toolkit.sweep.experiment import DEFAULT_NSGA2_POPULATION, Experiment, load_experiment
from dlm_toolkit import provenance
from dlm_toolkit.registry import imports_allowed, set_allow_imports
from dlm_toolkit.sweep.pareto import ParetoSummary, encode_outcomes, preset_label, summarize
from dlm_toolkit.sweep.tracking import Tracker, TrialRun, check_sqlite_folder, creation_lock, hide_password

DEFAULT_STORAGE = "sqlite:///optuna.db"
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_HEARTBEAT = 10
MAX_RETRY = 3


# -- storage and study -------------------------------------------------------------------------
def open_storage(url: str, heartbeat_interval: int | None = DEFAULT_HEARTBEAT, grace_period: int | None = None) -> Any:
    """An Optuna ``RDBStorage`` for any SQLAlchemy URL, with heartbeat and retry of dead trials.

    Raises:
        ConfigError: a SQLite file in a missing folder, a missing database driver, an
            unreachable server, or any other failure to open the storage.
    """
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    check_sqlite_folder(url, "storage")
    if url.startswith("sqlite"):
        engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}}
    elif url.startswith(("postgresql", "mysql")):
        engine_kwargs = {"pool_pre_ping": True, "connect_args": {"connect_timeout": 10}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            kwargs: dict[str, Any] = {}
            if heartbeat_interval:
                kwargs = {"heartbeat_interval": int(heartbeat_interval),
                          "grace_period": int(grace_period or 3 * heartbeat_interval),
                          "heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)}
            with creation_lock(url):  # schema creation and migration: one process at a time
                return RDBStorage(url, engine_kwargs=engine_kwargs, **kwargs)
    except ModuleNotFoundError as err:
        raise ConfigError(f"storage {hide_password(url)!r}: database driver not installed ({err}); "
                          "e.g. pip install psycopg2-binary for postgresql://") from None
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"storage {hide_password(url)!r}: cannot open: {first}") from None


def load_study(storage: str | Any, study_name: str) -> Any:
    """An existing study (``ConfigError`` listing the storage's studies if there is none)."""
    import optuna

    if isinstance(storage, str):
        from dlm_toolkit.sweep.tracking import sqlite_file

        check_sqlite_folder(storage, "storage")
        db = sqlite_file(storage)
        if db is not None and not db.exists():
            raise ConfigError(f"storage {storage!r}: database file {db} does not exist")
    store = open_storage(storage, heartbeat_interval=None) if isinstance(storage, str) else storage
    try:
        return optuna.load_study(study_name=study_name, storage=store)
    except KeyError:
        names = optuna.get_all_study_names(store)
        raise ConfigError(f"no study named {study_name!r} in {hide_password(str(getattr(store, 'url', storage)))}"
                          f" (studies: {', '.join(names) or 'none'})") from None


def sampler_seed(seed: int | None, worker: int, started: int) -> int | None:
    """The seed of one sampler: mixed from the experiment's seed, the worker id and the number of
    trials the study had when the sampler started, so a restarted (or resumed) process continues
    the search instead of replaying the proposals its predecessor already made."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}|{worker}|{started}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def make_sampler(exp: Experiment, worker: int = 0, started: int = 0) -> Any:
    """The experiment's sampler for ``worker``; ``started``: trials in the study when it starts."""
    import optuna

    spec = exp.sampler
    seed = sampler_seed(spec.seed, worker, started)
    opts = dict(spec.options)
    if spec.name == "nsga2":
        opts.setdefault("population_size", DEFAULT_NSGA2_POPULATION)
        return optuna.samplers.NSGAIISampler(seed=seed, **opts)
    if spec.name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, **opts)
    if spec.name == "random":
        return optuna.samplers.RandomSampler(seed=seed, **opts)
    grid = {k: s.grid_values() for k, s in exp.search_space.items()}
    return optuna.samplers.GridSampler(grid, seed=seed, **opts)


def make_pruner(exp: Experiment) -> Any:
    import optuna

    if exp.pruning.rule == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=exp.pruning.n_startup_trials,
                                           n_warmup_steps=exp.pruning.after)
    return optuna.pruners.NopPruner()


@contextmanager
def _optuna_quiet() -> Iterator[None]:
    """Optuna logs every trial (and a traceback per failure); the sweep prints its own lines."""
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(level)


def create_or_resume(exp: Experiment, storage: Any, study_name: str) -> Any:
    """Create the study, or load it after checking it was made with the same settings."""
    import optuna

    import dlm_toolkit

    with _optuna_quiet():
        study = optuna.create_study(storage=storage, study_name=study_name, directions=exp.directions,
                                    sampler=make_sampler(exp), pruner=make_pruner(exp), load_if_exists=True)
    started = len(study.get_trials(deepcopy=False))
    if started:
        study.sampler = make_sampler(exp, 0, started)  # a resumed study: continue, do not replay
    stored = study.user_attrs.get("experiment")
    if stored is None:
        if study.get_trials(deepcopy=False):
            raise ConfigError(f"study {study_name!r} already exists and was not created by `dlm sweep` "
                              "(no 'experiment' user attribute); choose another --study-name")
        if [d.name.lower() for d in study.directions] != exp.directions:
            raise ConfigError(f"study {study_name!r} exists with directions "
                              f"{[d.name.lower() for d in study.directions]}; choose another --study-name")
        study.set_user_attr("experiment", exp.settings())
        study.set_user_attr("dlm_toolkit_version", dlm_toolkit.__version__)
        return study
    now = exp.result_settings()
    old = {k: stored.get(k) for k in now}
    if json.dumps(old, sort_keys=True) != json.dumps(now, sort_keys=True):
        changed = [k for k in now if json.dumps(old[k], sort_keys=True) != json.dumps(now[k], sort_keys=True)]
        detail = "; ".join(f"{k}: {_short(old[k])} -> {_short(now[k])}" for k in changed)
        raise ConfigError(f"study {study_name!r} was created with different settings ({detail}); "
                          "resume it with the original experiment file or use another --study-name")
    if stored != exp.settings():  # operational settings (sampler, pruning, presets, ...) may change
        study.set_user_attr("experiment", exp.settings())
    return study


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def enqueue_presets(study: Any, exp: Experiment) -> list[str]:
    """Enqueue each preset once per study; returns the names enqueued now."""
    done = list(study.user_attrs.get("presets_enqueued") or [])
    existing = {t.user_attrs.get("preset") for t in study.get_trials(deepcopy=False)}
    added = []
    for preset in exp.presets_to_enqueue:
        label = preset_label(preset)
        if label in done or label in existing:
            continue
        policy = load_policy(preset)
        params = preset_params(exp, policy)
        study.enqueue_trial(params, user_attrs={"preset": label, "preset_policy": policy.canonical_json()},
                            skip_if_exists=False)
        done.append(label)
        added.append(label)
        study.set_user_attr("presets_enqueued", done)
    return added


def preset_params(exp: Experiment, policy: PolicyConfig) -> dict[str, Any]:
    """The preset's values of the search-space keys that are points of the space."""
    flat = policy.flat()
    values = {f"{r}.name": getattr(policy, r).name for r in ROLES}
    values.update(flat)
    out: dict[str, Any] = {}
    for key in exp.key_order():
        spec = exp.search_space[key]
        if key not in values or not spec.active(values):
            continue
        if spec.contains(values[key]):
            out[key] = values[key]
    return out


def trial_policy(exp: Experiment, params: Mapping[str, Any]) -> PolicyConfig:
    """Base policy + sampled flat params. Picking the base's own rule keeps the base's params."""
    base = exp.base()
    overrides = dict(params)
    for role in ROLES:
        key = f"{role}.name"
        if key in overrides and overrides[key] == getattr(base, role).name:
            del overrides[key]
    return load_policy(base, overrides)


def sample_params(trial: Any, exp: Experiment) -> dict[str, Any]:
    """Suggest every active key, in dependency order (``when`` conditions)."""
    values: dict[str, Any] = {}
    for key in exp.key_order():
        spec = exp.search_space[key]
        if spec.active(values):
            values[key] = spec.suggest(trial, key)
    return values


# -- counting ----------------------------------------------------------------------------------
def is_counted(trial: Any) -> bool:
    """Whether a trial counts toward ``n_trials`` (see the module docstring)."""
    from optuna.trial import TrialState

    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and bool(trial.user_attrs.get("error"))


FOREIGN_AFTER_S = 120.0


def is_ours_running(trial: Any) -> bool:
    """A RUNNING trial of a sweep worker (alive, or dead until its heartbeat expires).

    A sweep trial records its ``worker`` within moments of starting. A RUNNING trial without it
    after ``FOREIGN_AFTER_S`` seconds was made by something else (``study.ask()`` in a notebook);
    it has no heartbeat and would never finish, so sweeps do not wait for it.
    """
    import datetime

    from optuna.trial import TrialState

    if trial.state != TrialState.RUNNING:
        return False
    if trial.user_attrs.get("worker") or trial.datetime_start is None:
        return True
    age = (datetime.datetime.now() - trial.datetime_start).total_seconds()
    return age < FOREIGN_AFTER_S


@dataclass
class Counts:
    counted: int
    running: int
    waiting: int
    complete: int
    pruned: int
    failed: int  # with an error (counted)

    @classmethod
    def of(cls, study: Any) -> Counts:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        return cls(
            counted=sum(is_counted(t) for t in trials),
            running=sum(is_ours_running(t) for t in trials),
            waiting=sum(t.state == TrialState.WAITING for t in trials),
            complete=sum(t.state == TrialState.COMPLETE for t in trials),
            pruned=sum(t.state == TrialState.PRUNED for t in trials),
            failed=sum(t.state == TrialState.FAIL and bool(t.user_attrs.get("error")) for t in trials),
        )


class _Surplus(Exception):
    """This trial would exceed ``n_trials`` (another worker got there first)."""


class _Pruned(Exception):
    pass


# -- the trial ---------------------------------------------------------------------------------
class TrialRunner:
    """Runs trials of one study in this process: model loaded once, one MLflow run per trial."""

    def __init__(self, exp: Experiment, study: Any, storage_url: str, n_trials: int, tracker: Tracker,
                 parent_run_id: str, model: Any = None, tokenizer: Any = None,
                 echo: Any = None, device: str | None = None, dtype: str | None = None) -> None:
        from dlm_toolkit.tasks import get_task

        self.exp, self.study, self.storage_url, self.n_trials = exp, study, storage_url, n_trials
        self.tracker, self.parent_run_id = tracker, parent_run_id
        if model is None:
            from dlm_toolkit.evaluate import load_checkpoint

            model, tokenizer = load_checkpoint(exp.model, device=device, dtype=dtype)
        self.model, self.tokenizer = model, tokenizer
        self.task = get_task(exp.task, **exp.task_args)
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr))

    def objective(self, trial: Any) -> list[float]:
        import optuna

        from dlm_toolkit.evaluate import evaluate

        self._check_surplus(trial)
        import torch

        exp = self.exp
        preset = trial.user_attrs.get("preset")
        run: TrialRun | None = None
        for stale in ("metrics", "outcomes", "plugin_hashes", "pruned_at", "interrupted", "policy", "policy_hash", "mlflow_run_id"):
            if trial.user_attrs.get(stale) is not None:  # a retry inherits its predecessor's attributes
                trial.set_user_attr(stale, None)
        try:
            run = self.tracker.start_trial(self.parent_run_id, self.study.study_name, self.storage_url,
                                           trial.number, {"task": exp.task, "checkpoint": exp.model,
                                                          "seed": exp.seed, "preset": preset})
            trial.set_user_attr("mlflow_run_id", run.run_id)
            trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
            if preset:
                policy = load_policy(json.loads(trial.user_attrs["preset_policy"]))
                fixed = preset_params(exp, policy)  # enqueued as fixed params: suggest returns them
                params = {k: exp.search_space[k].suggest(trial, k) for k in fixed}
            else:
                params = sample_params(trial, exp)
                try:
                    policy = trial_policy(exp, params)
                except ConfigError:
                    run.log_params(params)
                    raise
            trial.set_user_attr("policy", policy.canonical_json())
            trial.set_user_attr("policy_hash", policy.config_hash())
            run.log_policy(policy)
            prov = provenance.collect(policy, self.model)
            run.log_provenance(prov)
            trial.set_user_attr("plugin_hashes", provenance.plugin_hashes(prov))  # dlm replay compares

            def on_batch(n_done: int, running: Mapping[str, float]) -> None:
                run.log_running(n_done, running)
                if not preset:  # presets are the reference points: never pruned
                    self._maybe_prune(trial, n_done, running)

            result = evaluate(self.model, self.tokenizer, self.task, policy, exp.n, exp.seed,
                              batch_size=exp.batch_size, progress=False, on_batch=on_batch,
                              threads=torch.get_num_threads())  # run_sweep chose this process's share
            metrics = {k: float(v) for k, v in result.metrics.items()}
            trial.set_user_attr("metrics", metrics)
            trial.set_user_attr("outcomes", encode_outcomes([r["score"] for r in result.records]))
            run.log_records(result.records)
            run.finish("FINISHED", "COMPLETE", metrics)
            return [metrics[m] for m in exp.metric_names]
        except _Pruned as pruned:
            if run is not None:
                run.finish("FINISHED", "PRUNED", tags={"pruned_at": str(pruned)})
            raise optuna.TrialPruned(str(pruned)) from None
        except optuna.TrialPruned as pruned:
            if run is not None:
                run.finish("FINISHED", "PRUNED", tags={"pruned_at": str(pruned)})
            raise
        except Exception as err:
            message = f"{type(err).__name__}: {err}"
            trial.set_user_attr("error", message)
            self.echo(f"trial {trial.number} FAILED: {message}")
            if run is not None:
                run.finish("FAILED", "FAIL", tags={"error": message})
            raise
        except BaseException:  # KeyboardInterrupt, SystemExit: retried on the next run
            trial.set_user_attr("interrupted", True)
            if run is not None and not run.closed:
                try:
                    run.finish("KILLED", "KILLED", tags={"killed_reason": "interrupted"})
                except Exception:
                    pass
            raise

    def _check_surplus(self, trial: Any) -> None:
        trials = self.study.get_trials(deepcopy=False)
        counted = sum(is_counted(t) for t in trials)
        before = sum(is_ours_running(t) and t.number < trial.number for t in trials)
        if counted + before >= self.n_trials:
            trial.set_user_attr("surplus", True)
            raise _Surplus(f"trial {trial.number} would exceed n_trials={self.n_trials}")

    def _maybe_prune(self, trial: Any, n_done: int, running: Mapping[str, float]) -> None:
        rule = self.exp.pruning
        if rule.rule == "threshold":
            if n_done >= rule.after and running["accuracy"] < rule.min_quality:
                info = {"n": n_done, "accuracy": running["accuracy"], "rule": f"accuracy < {rule.min_quality}"}
                trial.set_user_attr("pruned_at", info)
                raise _Pruned(f"running accuracy {running['accuracy']:.4g} < {rule.min_quality} after {n_done} instances")
        elif rule.rule == "median":
            metric = self.exp.metric_names[0]
            trial.report(float(running[metric]), n_done)
            if trial.should_prune():
                trial.set_user_attr("pruned_at", {"n": n_done, metric: running[metric], "rule": "median"})
                raise _Pruned(f"median rule: running {metric} {running[metric]:.4g} after {n_done} instances")

    # -- the loop ----------------------------------------------------------------------------
    def run(self, on_progress: Any = None, poll: float = 1.0) -> Counts:
        """Run trials until the study has ``n_trials`` finished ones (see module docstring)."""
        from optuna.storages import fail_stale_trials

        study = self.study
        told_waiting = False
        while True:
            with _optuna_quiet():
                fail_stale_trials(study)
            self.tracker.reconcile(study, self.storage_url)
            counts = Counts.of(study)
            if on_progress is not None:
                on_progress(counts)
            if counts.counted >= self.n_trials:
                return counts
            exhausted = counts.waiting == 0 and _grid_exhausted(study)
            if exhausted and counts.running == 0:
                self.echo(f"grid exhausted after {counts.counted} trials (n_trials={self.n_trials})")
                return counts
            if not exhausted and counts.counted + counts.running < self.n_trials:
                told_waiting = False
                try:
                    with _optuna_quiet():
                        study.optimize(self.objective, n_trials=1, catch=(Exception,))
                except KeyboardInterrupt:
                    self._requeue_interrupted()
                    raise
                continue
            if not told_waiting:
                self.echo(f"waiting for {counts.running} running trial(s) to finish: another worker's, or one "
                          "whose process died (retried once its heartbeat expires)")
                told_waiting = True
            time.sleep(poll)

    def _requeue_interrupted(self) -> None:
        """Interrupted trials are retried like killed ones (same params, same user attributes)."""
        from optuna.storages import RetryHeartbeatStaleTrialCallback
        from optuna.trial import TrialState

        retried = {n for t in self.study.get_trials(deepcopy=False) for n in t.system_attrs.get("retry_history", [])}
        with _optuna_quiet():
            for t in self.study.get_trials(deepcopy=False):
                if t.state == TrialState.FAIL and t.user_attrs.get("interrupted") and t.number not in retried:
                    RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)(self.study, t)


def _grid_exhausted(study: Any) -> bool:
    import optuna

    sampler = study.sampler
    return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study)


# -- the sweep ---------------------------------------------------------------------------------
@dataclass
class SweepResult:
    study_name: str
    storage: str
    tracking_uri: str
    parent_run_id: str
    n_trials: int
    counts: Counts
    summary: ParetoSummary
    exhausted: bool = False  # the grid sampler ran every grid point before n_trials

    @property
    def complete(self) -> bool:
        """The study reached ``n_trials`` finished trials (or its grid is exhausted)."""
        return self.counts.counted >= self.n_trials or self.exhausted


def check_resources(exp: Experiment, storage: str, tracking_uri: str, heartbeat_interval: int = DEFAULT_HEARTBEAT,
                    grace_period: int | None = None, device: str | None = None,
                    dtype: str | None = None) -> tuple[Any, Any, Any, Tracker]:
    """Open everything a sweep needs, or fail with a ConfigError before any trial runs.

    Returns ``(model, tokenizer, storage, tracker)``.
    """
    from dlm_toolkit.evaluate import check_task_context, load_checkpoint
    from dlm_toolkit.policy import DecodingPolicy
    from dlm_toolkit.tasks import get_task

    check_sqlite_folder(storage, "storage")
    check_sqlite_folder(tracking_uri, "tracking URI")
    model_dir = Path(exp.model)
    if not model_dir.is_dir():
        raise ConfigError(f"model: checkpoint folder {model_dir} does not exist")
    model, tokenizer = load_checkpoint(model_dir, device=device, dtype=dtype)
    task = get_task(exp.task, **exp.task_args)
    prompts = [tokenizer.encode(i.prompt, add_special_tokens=False) for i in task.instances(exp.n, exp.seed, "eval")]
    needed = max(map(len, prompts)) + task.answer_length + 1
    for source in (exp.base_policy, *exp.presets_to_enqueue):
        check_task_context(model, needed, DecodingPolicy(source), exp.task)
    store = open_storage(storage, heartbeat_interval, grace_period)
    tracker = Tracker(tracking_uri, exp.mlflow_experiment)
    return model, tokenizer, store, tracker


def run_sweep(
    experiment: Experiment | str | Path,
    n_trials: int | None = None,
    storage: str = DEFAULT_STORAGE,
    tracking_uri: str = DEFAULT_TRACKING_URI,
    study_name: str | None = None,
    workers: int = 1,
    progress: bool = True,
    *,
    heartbeat_interval: int = DEFAULT_HEARTBEAT,
    grace_period: int | None = None,
    threads: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    devices: Sequence[str] | None = None,
) -> SweepResult:
    """Search decoding policies for ``experiment`` until the study holds ``n_trials`` finished trials.

    Args:
        experiment: an :class:`Experiment` or the path of its YAML file.
        n_trials: target total of finished trials (COMPLETE + PRUNED + FAIL with an error);
            default: the experiment's ``n_trials``.
        storage: Optuna storage, any SQLAlchemy URL (SQLite default; PostgreSQL for many machines).
        tracking_uri: MLflow tracking store.
        study_name: default: the experiment's ``name`` (or its file's stem).
        workers: processes evaluating trials in parallel on this machine.
        progress: tqdm bar (stderr) with the number of finished trials and the front size.
        heartbeat_interval, grace_period: seconds; a trial without heartbeat for
            ``grace_period`` (default 3 x interval) is considered dead and retried.
        threads: torch CPU threads per worker (default: the experiment's ``threads``, else
            torch's choice with one worker and ``cpu_count // workers`` with several). Tiny
            models decode fastest with 1.
        device, dtype: where every worker loads the model (default: the experiment's ``device`` /
            ``dtype``, else the CPU in float32; see :mod:`dlm_toolkit.runtime`).
        devices: one worker per device (``["cuda:0", "cuda:1"]``); sets ``workers``. Each worker
            loads the model once, on its device.

    Raises:
        ConfigError: any invalid input (before any trial runs).
    """
    exp = experiment if isinstance(experiment, Experiment) else load_experiment(experiment)
    n_trials = n_trials if n_trials is not None else exp.n_trials
    if n_trials is None or isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials: must be an integer >= 1 (got {n_trials!r}); give --n-trials or n_trials in the file")
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers: must be an integer >= 1 (got {workers!r})")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads: must be an integer >= 1 (got {threads!r})")
    threads = threads or exp.threads
    from dlm_toolkit.runtime import resolve_device, resolve_dtype

    if exp.allow_import:  # the experiment opted in to package.module:Class names
        set_allow_imports(True)

    device, dtype = device or exp.device, dtype or exp.dtype
    if devices:
        if workers not in (1, len(devices)):
            raise ConfigError(f"workers: {workers} workers but {len(devices)} devices; --devices sets one worker per device")
        workers = len(devices)
    placement = [str(resolve_device(d)) for d in (devices or [device] * workers)]  # bad devices fail here
    for d in set(placement):
        resolve_dtype(dtype, resolve_device(d))
    name = study_name or exp.default_name
    # Workers 1..K-1 start now: their imports (torch, MLflow, Optuna; seconds) overlap the checks
    # below. They wait for their orders on stdin; if the checks fail, EOF sends them home.
    spawned = [subprocess.Popen(worker_command(), stdin=subprocess.PIPE, text=True)
               for _ in range(1, workers)]
    try:
        model, tokenizer, store, tracker = check_resources(exp, storage, tracking_uri, heartbeat_interval,
                                                           grace_period, placement[0], dtype)
        study = create_or_resume(exp, store, name)
        enqueue_presets(study, exp)
        parent = tracker.parent_run(name, storage, exp.settings(), exp.source)
    except BaseException:
        _dismiss(spawned)
        raise
    bar = _Progress(study, n_trials, enabled=progress)
    status = "KILLED"
    import torch

    saved_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or (saved_threads if workers == 1 else max(1, (os.cpu_count() or 1) // workers)))
        runner = TrialRunner(exp, study, storage, n_trials, tracker, parent, model, tokenizer, echo=bar.write)
        if workers == 1:
            counts = runner.run(on_progress=bar.update)
        else:
            counts = _run_workers(exp, storage, tracking_uri, name, n_trials, parent, spawned,
                                  heartbeat_interval, grace_period, bar, runner, placement, dtype)
        status = "FINISHED" if counts.counted >= n_trials or _grid_exhausted(study) else "FAILED"
    finally:
        _dismiss(spawned)
        torch.set_num_threads(saved_threads)
        bar.close()
        with _optuna_quiet():
            from optuna.storages import fail_stale_trials

            fail_stale_trials(study)
        tracker.reconcile(study, storage)
        summary = summarize(study)
        tracker.log_pareto(parent, summary)
        tracker.finish_parent(parent, status)
    return SweepResult(name, storage, tracking_uri, parent, n_trials, counts, summary, _grid_exhausted(study))


class _Progress:
    """tqdm bar over finished trials, with the current Pareto front size."""

    def __init__(self, study: Any, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.study = study
        self.bar = tqdm(total=total, desc=f"sweep {study.study_name}", unit="trial", disable=not enabled,
                        initial=min(Counts.of(study).counted, total), file=sys.stderr)
        self._last = -1

    def update(self, counts: Counts) -> None:
        if counts.counted == self._last:
            return
        self._last = counts.counted
        front = len(summarize(self.study).front)
        self.bar.n = min(counts.counted, self.bar.total)
        self.bar.set_postfix(front=front, pruned=counts.pruned, failed=counts.failed, refresh=False)
        self.bar.refresh()

    def write(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def worker_command() -> list[str]:
    """A worker's command line: ``python -I`` (no current folder, no ``PYTHON*`` variables, no user
    site on the import path, so a planted ``mlflow.py`` in the working folder is never imported)
    plus this process's import path, explicitly, minus the working folder."""
    cwd = os.getcwd()
    path = [p for p in sys.path if p and os.path.abspath(p) != cwd]
    boot = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from dlm_toolkit.sweep.worker import entry; entry()"
    return [sys.executable, "-I", "-c", boot, json.dumps(path)]


def _run_workers(exp: Experiment, storage: str, tracking_uri: str, study_name: str, n_trials: int,
                 parent: str, procs: list[subprocess.Popen], heartbeat_interval: int, grace_period: int | None,
                 bar: _Progress, runner: TrialRunner, placement: list[str], dtype: str | None) -> Counts:
    """Worker 0 is this process (model and stores already open); ``procs`` are workers 1..K-1,
    started early by :func:`run_sweep` and waiting for their payload on stdin."""
    import torch

    threads = torch.get_num_threads()  # run_sweep set this process's share; each worker gets the same
    for k, proc in enumerate(procs, start=1):
        payload = {"experiment": exp.settings(), "source": str(exp.source) if exp.source else None,
                   "storage": storage, "tracking_uri": tracking_uri, "study_name": study_name,
                   "n_trials": n_trials, "parent_run_id": parent, "worker": k, "threads": threads,
                   "heartbeat_interval": heartbeat_interval, "grace_period": grace_period,
                   "device": placement[k], "dtype": dtype, "allow_import": imports_allowed()}
        try:
            proc.stdin.write(json.dumps(payload) + "\n")
            proc.stdin.close()
        except (BrokenPipeError, OSError):  # it died while starting: the others carry on
            pass
    study = bar.study
    try:
        counts = runner.run(on_progress=bar.update)
        while any(p.poll() is None for p in procs):  # they stop at n_trials too; wait for their clean-up
            bar.update(Counts.of(study))
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        raise
    counts = Counts.of(study)
    bar.update(counts)
    bad = [(k, p.returncode) for k, p in enumerate(procs, start=1) if p.returncode != 0]
    if bad and counts.counted < n_trials:
        bar.write("workers exited with errors: " + ", ".join(f"worker {k}: exit {rc}" for k, rc in bad))
    return counts


def _dismiss(procs: list[subprocess.Popen]) -> None:
    """Close the orders pipe of workers still waiting (they exit) and reap every worker."""
    for p in procs:
        if p.stdin and not p.stdin.closed:
            try:
                p.stdin.close()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker_main(payload: Mapping[str, Any]) -> int:
    """Entry of one worker process (``python -m dlm_toolkit.sweep.worker PAYLOAD_JSON``)."""
    import torch

    torch.set_num_threads(int(payload["threads"]))
    set_allow_imports(bool(payload.get("allow_import")))
    exp = Experiment.model_validate(payload["experiment"])
    if payload.get("source"):
        exp._source = Path(payload["source"])
    store = open_storage(payload["storage"], payload["heartbeat_interval"], payload["grace_period"])
    import optuna

    with _optuna_quiet():
        study = optuna.load_study(study_name=payload["study_name"], storage=store, pruner=make_pruner(exp))
        study.sampler = make_sampler(exp, int(payload["worker"]), len(study.get_trials(deepcopy=False)))
    tracker = Tracker(payload["tracking_uri"], exp.mlflow_experiment)
    runner = TrialRunner(exp, study, payload["storage"], int(payload["n_trials"]), tracker,
                         payload["parent_run_id"], device=payload.get("device"), dtype=payload.get("dtype"))
    runner.run()
    return 0
