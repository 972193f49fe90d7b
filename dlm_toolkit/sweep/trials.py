"""Trials in one process: which trials count toward ``n_trials``, and :class:`TrialRunner`, which
evaluates trials of a study (model loaded once, one MLflow run per trial) until the study is full."""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping

from dlm_toolkit.sweep import provenance
from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import parse_json
from dlm_toolkit.strategy.policy_config import load_policy
from dlm_toolkit.sweep.experiment import Experiment
from dlm_toolkit.sweep.params import preset_params, sample_params, trial_policy
from dlm_toolkit.sweep.pareto import encode_outcomes, params_text
from dlm_toolkit.sweep.reference import reference_gaps, study_reference
from dlm_toolkit.sweep.storage import (DEFAULT_RECONNECT, MAX_RETRY, lost_connection, optuna_quiet,
                                       wait_for_storage)
from dlm_toolkit.sweep.tracking import Tracker, TrackingLost, TrialRun

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


def trial_line(number: int, state: str, metrics: Mapping[str, float], preset: str | None = None,
               note: str = "") -> str:
    """The one line a sweep prints per finished trial."""
    extra = [f"preset {preset}"] if preset else []
    extra += [note] if note else []
    return (f"trial {number} {state}  accuracy {metrics['accuracy']:.4f}  tpf {metrics['tpf']:.3f}  "
            f"nfe_mean {metrics['nfe_mean']:.2f}" + (f"  ({'; '.join(extra)})" if extra else ""))


class TrialRunner:
    """Runs trials of one study in this process: model loaded once, one MLflow run per trial."""

    def __init__(self, exp: Experiment, study: Any, storage_url: str, n_trials: int, tracker: Tracker,
                 parent_run_id: str, model: Any = None, tokenizer: Any = None,
                 echo: Any = None, device: str | None = None, dtype: str | None = None,
                 reconnect_s: float = DEFAULT_RECONNECT) -> None:
        from dlm_toolkit.tasks import get_task

        self.exp, self.study, self.storage_url, self.n_trials = exp, study, storage_url, n_trials
        self.tracker, self.parent_run_id = tracker, parent_run_id
        self.reconnect_s = reconnect_s
        self.storage_failure: BaseException | None = None
        if model is None:
            from dlm_toolkit.evaluation.evaluate import load_checkpoint

            model, tokenizer = load_checkpoint(exp.model, device=device, dtype=dtype)
        self.model, self.tokenizer = model, tokenizer
        self.task = get_task(exp.task, **exp.task_args)
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr))
        # an oracle model: the reference rule's curve, once per study (each trial records its gap to it)
        self.reference = study_reference(study, self.model, self.tokenizer, self.task, exp)

    def objective(self, trial: Any) -> list[float]:
        import optuna

        from dlm_toolkit.evaluation.evaluate import evaluate

        self._check_surplus(trial)
        import torch

        exp = self.exp
        preset = trial.user_attrs.get("preset")
        run: TrialRun | None = None
        for stale in ("metrics", "outcomes", "plugin_hashes", "pruned_at", "interrupted", "policy", "policy_hash",
                      "mlflow_run_id", "duplicate_of"):
            if trial.user_attrs.get(stale) is not None:  # a retry inherits its predecessor's attributes
                trial.set_user_attr(stale, None)
        try:
            run = self.tracker.start_trial(self.parent_run_id, self.study.study_name, self.storage_url,
                                           trial.number, {"task": exp.task, "checkpoint": exp.model,
                                                          "seed": exp.seed, "preset": preset or "none"})
            trial.set_user_attr("mlflow_run_id", run.run_id)
            trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
            if preset:
                policy = load_policy(parse_json(trial.user_attrs["preset_policy"], f"trial {trial.number}: preset_policy"))
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
            original = self._evaluated_before(trial, policy.config_hash(), provenance.plugin_hashes(prov))
            if original is not None:  # the sampler proposed a policy this study already measured
                metrics = dict(original.user_attrs["metrics"])
                trial.set_user_attr("metrics", metrics)
                trial.set_user_attr("outcomes", original.user_attrs.get("outcomes"))
                trial.set_user_attr("duplicate_of", original.number)
                run.finish("FINISHED", "COMPLETE", metrics, tags={"duplicate_of": original.number})
                self.echo(trial_line(trial.number, "COMPLETE", metrics, preset, f"same policy as trial {original.number}"))
                return [metrics[m] for m in exp.metric_names]

            def on_batch(n_done: int, running: Mapping[str, float]) -> None:
                run.log_running(n_done, running)
                if not preset:  # presets are the reference points: never pruned
                    self._maybe_prune(trial, n_done, running)

            result = evaluate(self.model, self.tokenizer, self.task, policy, exp.n, exp.seed,
                              batch_size=exp.batch_size, progress=False, on_batch=on_batch, cuda_graphs=exp.cuda_graphs,
                              threads=torch.get_num_threads())  # run_sweep chose this process's share
            metrics = {k: float(v) for k, v in result.metrics.items()}
            if self.reference is not None:
                metrics.update(reference_gaps(self.reference, metrics))
            trial.set_user_attr("metrics", metrics)
            trial.set_user_attr("outcomes", encode_outcomes([r["score"] for r in result.records]))
            run.log_records(result.records)
            label = f"trial {trial.number}, " + (f"preset {preset}" if preset else params_text(params))
            run.log_trajectories(self.model, self.tokenizer, self.task, policy, exp.seed, min(2, exp.n), exp.cuda_graphs,
                                 label=label, checkpoint=exp.model)
            run.finish("FINISHED", "COMPLETE", metrics)
            self.echo(trial_line(trial.number, "COMPLETE", metrics, preset))
            return [metrics[m] for m in exp.metric_names]
        except (_Pruned, optuna.TrialPruned) as pruned:
            if run is not None:
                run.finish("FINISHED", "PRUNED", tags={"pruned_at": str(pruned)})
            self.echo(f"trial {trial.number} PRUNED: {pruned}")
            raise optuna.TrialPruned(str(pruned)) from None
        except TrackingLost:  # not the policy's fault: retried like a killed trial, once the loop stops
            trial.set_user_attr("interrupted", True)
            raise
        except Exception as err:
            if lost_connection(err) is not None:  # the storage failed, not the policy: the loop handles it
                self.storage_failure = err
                raise
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

    def _evaluated_before(self, trial: Any, policy_hash: str, plugin_hashes: Any) -> Any:
        """The first COMPLETE trial of this study with the same policy and plug-in code, if any.

        Task, ``n``, seed and checkpoint are fixed per study (a study refuses other result
        settings), so equal policy and plug-in hashes mean an identical evaluation. Two workers
        that draw the same new policy at the same moment may both evaluate it.
        """
        from optuna.trial import TrialState

        for other in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            attrs = other.user_attrs
            if (other.number != trial.number and attrs.get("policy_hash") == policy_hash
                    and attrs.get("plugin_hashes") == plugin_hashes and attrs.get("metrics")
                    and attrs.get("duplicate_of") is None):
                return other
        return None

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
        """Run trials until the study has ``n_trials`` finished ones (see module docstring).

        When the storage stops answering, waits up to ``reconnect_s`` seconds for it, then goes
        on (the trial in flight is retried by the heartbeat) or raises
        :class:`~dlm_toolkit.sweep.storage.StorageLost`. When the MLflow tracking server stops
        answering (after the MLflow client's retries, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``), the
        trial in flight is marked failed and queued for a retry, and
        :class:`~dlm_toolkit.sweep.tracking.TrackingLost` is raised.
        """
        while True:
            try:
                return self._run(on_progress, poll)
            except Exception as err:
                cause = lost_connection(err)
                if cause is None:
                    raise
                wait_for_storage(self.study, self.storage_url, cause, self.reconnect_s, self.echo)

    def _run(self, on_progress: Any, poll: float) -> Counts:
        from optuna.storages import fail_stale_trials

        study = self.study
        told_waiting = False
        while True:
            with optuna_quiet():
                fail_stale_trials(study)
            self.tracker.reconcile(study, self.storage_url)
            counts = Counts.of(study)
            if on_progress is not None:
                on_progress(counts)
            if counts.counted >= self.n_trials:
                return counts
            exhausted = counts.waiting == 0 and grid_exhausted(study)
            if exhausted and counts.running == 0:
                self.echo(f"grid exhausted after {counts.counted} trials (n_trials={self.n_trials})")
                return counts
            if not exhausted and counts.counted + counts.running < self.n_trials:
                told_waiting = False
                try:
                    with optuna_quiet():
                        study.optimize(self.objective, n_trials=1, catch=(Exception,))
                except KeyboardInterrupt:
                    self._requeue_interrupted()
                    raise
                if self.storage_failure is not None:  # optimize() caught it: run() waits or gives up
                    failure, self.storage_failure = self.storage_failure, None
                    raise failure
                if self.tracker.lost is not None:  # optimize() caught it; the sweep cannot go on without MLflow
                    self._requeue_interrupted()
                    raise self.tracker.lost
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
        with optuna_quiet():
            for t in self.study.get_trials(deepcopy=False):
                if t.state == TrialState.FAIL and t.user_attrs.get("interrupted") and t.number not in retried:
                    RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)(self.study, t)


def grid_exhausted(study: Any) -> bool:
    import optuna

    sampler = study.sampler
    return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(study)
