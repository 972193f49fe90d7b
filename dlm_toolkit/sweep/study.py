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

Study user attributes: ``experiment.0 .. experiment.<parts-1>`` and ``experiment.parts`` (all
settings as JSON, split into pieces under 1 KB: :mod:`dlm_toolkit.sweep.attrs`; a study cannot be
resumed with different result-relevant settings), ``presets_enqueued``, ``dlm_toolkit_version``;
the objectives are the study's metric names.
Trial user attributes: ``policy`` (canonical JSON), ``policy_hash``, ``metrics``, ``preset`` and
``preset_policy``, ``error``, ``pruned_at``, ``mlflow_run_id``, ``worker`` (host:pid),
``interrupted``, ``surplus``, ``duplicate_of``.
"""

from __future__ import annotations

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dlm_toolkit.config import ConfigError
from dlm_toolkit.strategy.registry import set_allow_imports
from dlm_toolkit.sweep.experiment import Experiment, load_experiment
from dlm_toolkit.sweep.pareto import ParetoSummary, summarize
from dlm_toolkit.sweep.params import enqueue_presets
from dlm_toolkit.sweep.storage import new_sqlite_files, remove_unused
from dlm_toolkit.sweep.storage import (DEFAULT_HEARTBEAT, DEFAULT_RECONNECT, DEFAULT_STORAGE, DEFAULT_TRACKING_URI,
                                       StorageLost, create_or_resume, lost_connection, open_storage, optuna_quiet,
                                       quiet_storage_threads, root_line)
from dlm_toolkit.sweep.tracking import Tracker, TrackingLost
from dlm_toolkit.sweep.uris import check_sqlite_folder, check_store_kind, hide_password
from dlm_toolkit.sweep.trials import Counts, TrialRunner, grid_exhausted
from dlm_toolkit.sweep.worker import dismiss, run_workers, worker_command

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
    experiment_id: str = ""  # the MLflow experiment holding the parent run
    already_finished: bool = False  # the study held n_trials finished trials before this call: nothing ran

    @property
    def complete(self) -> bool:
        """The study reached ``n_trials`` finished trials (or its grid is exhausted)."""
        return self.counts.counted >= self.n_trials or self.exhausted


def check_resources(exp: Experiment, storage: str, tracking_uri: str, heartbeat_interval: int = DEFAULT_HEARTBEAT,
                    grace_period: int | None = None, device: str | None = None,
                    dtype: str | None = None, store: Any = None) -> tuple[Any, Any, Any, Tracker]:
    """Open everything a sweep needs, or fail with a ConfigError before any trial runs.

    Returns ``(model, tokenizer, storage, tracker)``; ``store``: the storage, already open.
    """
    from dlm_toolkit.evaluation.evaluate import check_task_context, load_checkpoint
    from dlm_toolkit.decoding.policy import DecodingPolicy
    from dlm_toolkit.tasks import get_task

    check_sqlite_folder(storage, "storage")
    check_sqlite_folder(tracking_uri, "tracking URI")
    from dlm_toolkit.models.oracle import is_oracle_spec

    model_dir = exp.model if is_oracle_spec(exp.model) else Path(exp.model)  # oracle:TASK: an exact model
    if not is_oracle_spec(exp.model) and not Path(model_dir).is_dir():
        raise ConfigError(f"model: checkpoint folder {model_dir} does not exist")
    model, tokenizer = load_checkpoint(model_dir, device=device, dtype=dtype)
    task = get_task(exp.task, **exp.task_args)
    prompts = [tokenizer.encode(i.prompt, add_special_tokens=False) for i in task.instances(exp.n, exp.seed, "eval")]
    needed = max(map(len, prompts)) + task.answer_length + 1
    for source in (exp.base_policy, *exp.presets_to_enqueue):
        check_task_context(model, needed, DecodingPolicy(source), exp.task)
    store = store if store is not None else open_storage(storage, heartbeat_interval, grace_period)
    tracker = Tracker(tracking_uri, exp.mlflow_experiment)
    return model, tokenizer, store, tracker


def place_workers(workers: int, device: str | None, devices: Sequence[str] | None = None,
                  dtype: str | None = None) -> list[str]:
    """The device of each worker: ``devices`` (one worker each), else ``workers`` times ``device``.

    Raises:
        ConfigError: a device this machine lacks, a dtype it cannot run there, or a ``workers``
            count that contradicts ``devices``.
    """
    from dlm_toolkit.util.runtime import resolve_device, resolve_dtype

    if devices:
        if workers not in (1, len(devices)):
            raise ConfigError(f"workers: {workers} workers but {len(devices)} devices; --devices sets one worker per device")
        workers = len(devices)
    placement = [str(resolve_device(d)) for d in (devices or [device] * workers)]
    for d in set(placement):
        resolve_dtype(dtype, resolve_device(d))
    return placement


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
    reconnect_s: float = DEFAULT_RECONNECT,
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
            ``dtype``, else the CPU in float32; see :mod:`dlm_toolkit.util.runtime`).
        devices: one worker per device (``["cuda:0", "cuda:1"]``); sets ``workers``. Each worker
            loads the model once, on its device.
        reconnect_s: how long every worker waits for a storage that stopped answering before it
            gives up with :class:`~dlm_toolkit.sweep.storage.StorageLost` (finished trials are
            kept; the same command continues later).

    Raises:
        ConfigError: any invalid input (before any trial runs).
    """
    exp = experiment if isinstance(experiment, Experiment) else load_experiment(experiment)
    n_trials = n_trials if n_trials is not None else exp.n_trials
    if n_trials is None or isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials: must be an integer >= 1 (got {n_trials!r}); give --n-trials or n_trials in the file")
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers: must be an integer >= 1 (got {workers!r})")
    if isinstance(reconnect_s, bool) or not isinstance(reconnect_s, (int, float)) or not 0 <= reconnect_s <= 86400:
        raise ConfigError(f"reconnect_s: must be a number of seconds in [0, 86400] (got {reconnect_s!r})")
    threads = exp.threads if threads is None else threads
    if threads is not None:
        from dlm_toolkit.util.runtime import resolve_threads

        resolve_threads(threads, small_model=True)  # an integer from 1 to the CPU count
    if exp.allow_import:  # the experiment opted in to package.module:Class names
        set_allow_imports(True)

    for url, what, kind in ((storage, "storage", "optuna"), (tracking_uri, "tracking URI", "mlflow")):
        check_sqlite_folder(url, what)  # before any worker starts, and before either store is written
        check_store_kind(url, what, kind)
    dtype = dtype or exp.dtype
    placement = place_workers(workers, device or exp.device, devices, dtype)
    workers = len(placement)
    name = study_name or exp.default_name
    # Workers 1..K-1 start once the storage answers: their imports (torch, MLflow, Optuna; seconds)
    # overlap the checks below. They wait for their orders on stdin; if the checks fail, EOF sends them home.
    created = new_sqlite_files(storage, tracking_uri)
    spawned: list[subprocess.Popen] = []
    try:
        # the storage answers before any worker starts (a server URL that does not is one line, no workers)
        store = open_storage(storage, heartbeat_interval, grace_period)
        finished = finished_result(exp, store, storage, tracking_uri, name, n_trials)
        if finished is not None:  # nothing to run: no model, no workers, nothing written
            return finished
        spawned = [subprocess.Popen(worker_command(), stdin=subprocess.PIPE, text=True)
                   for _ in range(1, workers)]
        model, tokenizer, store, tracker = check_resources(exp, storage, tracking_uri, heartbeat_interval,
                                                           grace_period, placement[0], dtype, store=store)
        try:
            study = create_or_resume(exp, store, name)
            enqueue_presets(study, exp)
        except Exception as err:
            if isinstance(err, ConfigError) or lost_connection(err) is None:
                raise
            raise StorageLost(f"storage {hide_password(storage)!r}: {root_line(err)} while preparing study "
                              f"{name!r}; no trial ran. Mend the storage (free space, write permission) and run "
                              "the same command again") from None
        parent = tracker.parent_run(name, storage, exp.settings(), exp.source)
    except BaseException:
        dismiss(spawned)
        remove_unused(created)  # a refused sweep leaves no empty store behind
        raise
    bar = SweepProgress(study, n_trials, enabled=progress,  # parent charts: one point per finished trial
                        on_summary=lambda summary: tracker.log_front_metrics(parent, summary))
    status = "KILLED"
    import torch

    saved_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads or (saved_threads if workers == 1 else max(1, (os.cpu_count() or 1) // workers)))
        runner = TrialRunner(exp, study, storage, n_trials, tracker, parent, model, tokenizer, echo=bar.write,
                             reconnect_s=reconnect_s)
        with quiet_storage_threads():
            if workers == 1:
                counts = runner.run(on_progress=bar.update)
            else:
                counts = run_workers(exp, storage, tracking_uri, name, n_trials, parent, spawned,
                                     heartbeat_interval, grace_period, bar, runner, placement, dtype)
        status = "FINISHED" if counts.counted >= n_trials or grid_exhausted(study) else "FAILED"
    finally:
        dismiss(spawned)
        torch.set_num_threads(saved_threads)
        bar.close()
        summary = None
        try:
            with optuna_quiet():
                from optuna.storages import fail_stale_trials

                fail_stale_trials(study)
            tracker.reconcile(study, storage)
            summary = summarize(study)
            tracker.log_pareto(parent, summary, study)
        except Exception as err:
            if lost_connection(err) is None and not isinstance(err, TrackingLost):
                raise
            # a store is gone: the error that ended the loop says so (or the lines below)
        if tracker.lost is None:
            tracker.finish_parent(parent, status)
    if tracker.lost is not None:
        raise tracker.lost
    if summary is None:
        raise StorageLost(f"storage {hide_password(storage)!r}: connection lost while closing the sweep; finished "
                          "trials are stored -- run the same command again to finish and summarise")
    return SweepResult(name, storage, tracking_uri, parent, n_trials, counts, summary, grid_exhausted(study),
                       tracker.experiment_id)


def finished_result(exp: Experiment, store: Any, storage: str, tracking_uri: str, name: str,
                    n_trials: int) -> SweepResult | None:
    """The result of a study that already holds ``n_trials`` finished trials of this experiment
    (same result settings, nothing running or waiting, its parent run in this MLflow store), read
    from the two stores without loading the model or writing anything; ``None`` for anything else,
    which the full path handles (and checks, refusing what it must)."""
    import json

    import optuna

    from dlm_toolkit.sweep.attrs import read_settings
    from dlm_toolkit.sweep.storage import optuna_quiet

    try:
        with optuna_quiet():
            study = optuna.load_study(study_name=name, storage=store)
    except KeyError:  # no such study yet
        return None
    stored = read_settings(study)
    now = exp.result_settings()
    if stored is None or json.dumps({k: stored.get(k) for k in now}, sort_keys=True) != json.dumps(now, sort_keys=True):
        return None
    counts = Counts.of(study)
    if counts.counted < n_trials or counts.running or counts.waiting:
        return None
    tracker = Tracker(tracking_uri, exp.mlflow_experiment)
    parent = tracker.find_parent(name, storage)
    if parent is None:
        return None
    return SweepResult(name, storage, tracking_uri, parent, n_trials, counts, summarize(study), False,
                       tracker.experiment_id, already_finished=True)


class SweepProgress:
    """tqdm bar over finished trials, with the current Pareto front size."""

    def __init__(self, study: Any, total: int, enabled: bool, on_summary: Any = None) -> None:
        from tqdm import tqdm

        self.study, self.on_summary = study, on_summary
        self.bar = tqdm(total=total, desc=f"sweep {study.study_name}", unit="trial", disable=not enabled,
                        initial=min(Counts.of(study).counted, total), file=sys.stderr)
        self._last = -1

    def update(self, counts: Counts) -> None:
        if counts.counted == self._last:
            return
        self._last = counts.counted
        summary = summarize(self.study)
        if self.on_summary is not None:
            self.on_summary(summary)
        front = len(summary.front)
        self.bar.n = min(counts.counted, self.bar.total)
        self.bar.set_postfix(front=front, pruned=counts.pruned, failed=counts.failed, refresh=False)
        self.bar.refresh()

    def write(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
