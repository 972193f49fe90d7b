"""MLflow tracking of sweeps and single evaluations.

Layout:

* one **parent run** per study (``kind=study``), found again on resume by its tags
  ``study_name`` and ``storage`` (the Optuna storage URL, password hidden), never duplicated;
  it holds the experiment settings and, after a sweep or ``dlm pareto --log``, ``pareto.png``,
  ``pareto.csv``, ``pareto.json`` and the summary metrics (hypervolume, auc, front_size, ...);
* one **nested run** per trial (``kind=trial``, tag ``mlflow.parentRunId``) with the policy's
  flat keys as params, the metrics, tags (``policy_hash``, ``study_name``, ``trial_number``,
  ``dlm_toolkit_version``, ``seed``, ``task``, ``checkpoint``, ``trial_state``, ``preset``,
  ``error``) and the ``policy.json`` artifact — the canonical policy JSON, the source of truth.
  The accuracy over the instances evaluated so far is the step metric ``progress.accuracy_so_far``
  (step = instances done; it moves as batches arrive, it is not a trend over time).

Run states: COMPLETE trial → FINISHED; PRUNED → FINISHED with ``trial_state=PRUNED``; a
policy/evaluation error → FAILED with the message in the ``error`` tag. A trial whose process
died cannot close its run; :meth:`Tracker.reconcile` (called when a sweep starts, between
trials and at its end) sets every RUNNING trial run whose Optuna trial is no longer running
to KILLED, with a ``killed_reason`` tag.

All calls go through :class:`mlflow.MlflowClient` with explicit run ids (no global active run),
so several worker processes can log into one store. Opening the store, its experiment and the
retried calls are :class:`~dlm_toolkit.sweep.mlflow_store.MlflowStore`'s (its names are importable
from here too).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from dlm_toolkit.strategy.policy_config import PolicyConfig
from dlm_toolkit.sweep.mlflow_store import (  # noqa: F401 -- names importable from here as before the split
    KIND_EVAL,
    KIND_STUDY,
    KIND_TRIAL,
    RUNS_VIEW,
    RUNS_VIEW_KEY,
    RUNS_VIEW_TAG,
    MlflowStore,
    TrackingLost,
    _version,
    run_page_url,
    runs_table_url,
)
from dlm_toolkit.sweep.uris import hide_password, hide_web_password


def parent_description(study_name: str, settings: Mapping[str, Any]) -> str:
    """The parent run's description (MLflow's ``mlflow.note.content`` tag, Markdown)."""
    return (f"Optuna study `{study_name}` searched by `dlm sweep`: task `{settings.get('task')}` "
            f"(n={settings.get('n')}, seed {settings.get('seed')}) on checkpoint `{settings.get('model')}`. "
            "Each trial is a nested run (its policy in `policy.json`). Metrics here: `n_complete` = COMPLETE "
            "trials, the number `dlm sweep` prints as 'complete'; `n_distinct_points` = the points of the "
            "front plots (a trial that proposed a policy already evaluated reuses its result, tag "
            "`duplicate_of`, and adds no point); `n_pruned`, `n_failed`; `front_size`, `hypervolume`, `auc` "
            "of the front in `pareto.png`/`pareto.html`. Run the same `dlm sweep` command again to resume "
            "or to add trials (`--n-trials`).")


class Tracker(MlflowStore):
    """An MLflow store plus one experiment in it, with the study's parent run and its trials' runs."""

    # -- parent runs -------------------------------------------------------------------------
    def find_parent(self, study_name: str, storage: str, all_experiments: bool = False) -> str | None:
        """Run id of the study's parent run (tags ``study_name`` + ``storage``), if any."""
        ids = [self.experiment_id]
        if all_experiments:
            ids = [e.experiment_id for e in self.client.search_experiments()]
        tag = hide_password(storage)
        runs = self._call(self.client.search_runs, ids, filter_string=f"tags.kind = '{KIND_STUDY}'",
                          max_results=5000, order_by=["attributes.start_time ASC"])
        for run in runs:
            if run.data.tags.get("study_name") == study_name and run.data.tags.get("storage") == tag:
                return run.info.run_id
        return None

    def parent_run(self, study_name: str, storage: str, settings: Mapping[str, Any],
                   experiment_file: Path | None = None) -> str:
        """Find the study's parent run (and mark it RUNNING again) or create it."""
        run_id = self.find_parent(study_name, storage)
        if run_id is not None:
            self._call(self.client.update_run, run_id, status="RUNNING")
            tags = self._call(self.client.get_run, run_id).data.tags
            if "mlflow.note.content" not in tags:  # a parent made before runs had a description
                self._call(self.client.set_tag, run_id, "mlflow.note.content", parent_description(study_name, settings))
            return run_id
        tags = {"kind": KIND_STUDY, "study_name": study_name, "storage": hide_password(storage),
                "dlm_toolkit_version": _version(), "task": str(settings.get("task")),
                "checkpoint": str(settings.get("model")), "seed": str(settings.get("seed"))}
        tags["mlflow.note.content"] = parent_description(study_name, settings)  # the run page's Description
        run = self._call(self.client.create_run, self.experiment_id, run_name=f"study-{study_name}", tags=tags)
        run_id = run.info.run_id
        from mlflow.entities import Param

        flat = {"task": settings.get("task"), "n": settings.get("n"), "seed": settings.get("seed"),
                "batch_size": settings.get("batch_size"), "sampler": json.dumps(settings.get("sampler")),
                "objectives": json.dumps(settings.get("objectives")), "pruning": json.dumps(settings.get("pruning")),
                "search_space": json.dumps(settings.get("search_space") or {}, sort_keys=True)}  # keys with ranges
        self._call(self.client.log_batch, run_id, params=[Param(k, str(v)[:6000]) for k, v in flat.items()])
        self._call(self.client.log_text, run_id, json.dumps(settings, indent=1, sort_keys=True), "experiment.json")
        if experiment_file is not None and experiment_file.is_file():
            self._call(self.client.log_artifact, run_id, str(experiment_file))
        return run_id

    def finish_parent(self, run_id: str, status: str = "FINISHED") -> None:
        self._call(self.client.set_terminated, run_id, status)

    def log_pareto(self, run_id: str, summary: Any, study: Any = None) -> None:
        """Artifacts ``pareto.png/.csv/.json/.html`` and summary metrics on the parent run; with
        ``study``, the ``on_front`` tag (true/false) on every COMPLETE trial's run, and the points of
        ``pareto.html`` link to their trial's run."""
        from dlm_toolkit.sweep.pareto import write_all

        runs = self.trial_links(study) if study is not None else None
        with tempfile.TemporaryDirectory() as tmp:
            for path in write_all(summary, tmp, runs).values():
                self._call(self.client.log_artifact, run_id, str(path))
        self.log_front_metrics(run_id, summary)
        if study is not None:
            self.tag_front(study, summary)

    def trial_links(self, study: Any) -> dict[int, str]:
        """Trial number -> its run's page (on the tracking server; a bare ``#/...`` path for a local
        store, which resolves inside an MLflow UI serving it)."""
        base = self.tracking_uri if self.tracking_uri.startswith(("http://", "https://")) else ""
        out = {}
        for t in study.get_trials(deepcopy=False):
            run_id = t.user_attrs.get("mlflow_run_id")
            if run_id:
                out[t.number] = run_page_url(hide_web_password(base), self.experiment_id, run_id)
        return out

    def tag_front(self, study: Any, summary: Any) -> None:
        """Tag ``on_front`` (true/false) on this store's runs of the study's COMPLETE trials.

        Only runs found here: the same study may have been swept into several MLflow stores.
        """
        from optuna.trial import TrialState

        front = {p.trial for p in summary.front}
        complete = {t.user_attrs.get("mlflow_run_id"): t.number
                    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}
        query = f"tags.kind = '{KIND_TRIAL}'"
        if "'" not in study.study_name:  # the filter language has no escapes; such names are filtered below only
            query += f" and tags.study_name = '{study.study_name}'"
        runs = self._call(self.client.search_runs, [self.experiment_id], filter_string=query, max_results=50000)
        for run in runs:
            number = complete.get(run.info.run_id) if run.data.tags.get("study_name") == study.study_name else None
            if number is not None and run.data.tags.get("on_front") != str(number in front).lower():
                self._call(self.client.set_tag, run.info.run_id, "on_front", str(number in front).lower())

    def log_front_metrics(self, run_id: str, summary: Any) -> None:
        """Front size, hypervolume, AUC, counts and preset comparisons on the parent run, at
        ``step`` = the highest finished trial number, so its charts are curves over the sweep."""
        from mlflow.entities import Metric

        step = max((p.trial for p in summary.points), default=0)
        now = int(time.time() * 1000)
        # n_complete counts COMPLETE trials as the sweep prints them; a trial that repeated a stored
        # policy reused its result (duplicate_of) and is no new point: n_distinct_points
        values: dict[str, float] = {"front_size": len(summary.front),
                                    "n_complete": summary.counts.get("complete", len(summary.points)),
                                    "n_distinct_points": len(summary.points)}
        for key in ("pruned", "failed"):
            values[f"n_{key}"] = summary.counts.get(key, 0)
        if summary.hypervolume is not None:
            values["hypervolume"] = summary.hypervolume
            values["auc"] = summary.auc
        for name, dom in summary.dominated_by.items():
            if summary.presets.get(name) is not None:
                values[f"n_dominating_{name}"] = len(dom)
            sp = summary.speedup_at_quality.get(name)
            if sp:
                values[f"speedup_at_quality_{name}"] = sp["ratio"]
        self._call(self.client.log_batch, run_id,
                   metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    # -- trial runs --------------------------------------------------------------------------
    def start_trial(self, parent_id: str, study_name: str, storage: str, trial_number: int,
                    tags: Mapping[str, Any]) -> TrialRun:
        what = f"preset {tags['preset']}" if tags.get("preset") not in (None, "none") else "a policy proposed by the sampler"
        all_tags = {"mlflow.parentRunId": parent_id, "kind": KIND_TRIAL, "study_name": study_name,
                    "mlflow.note.content": f"Trial {trial_number} of study '{study_name}': {what}, evaluated on "
                                           f"task {tags.get('task')} (seed {tags.get('seed')}); policy.json is the policy.",
                    "storage": hide_password(storage), "trial_number": str(trial_number),
                    "dlm_toolkit_version": _version(), "trial_state": "RUNNING",
                    **{k: str(v) for k, v in tags.items() if v is not None}}
        run = self._call(self.client.create_run, self.experiment_id, run_name=f"trial-{trial_number}", tags=all_tags)
        return TrialRun(self, run.info.run_id)

    def reconcile(self, study: Any, storage: str) -> list[str]:
        """Close RUNNING trial runs of ``study`` whose Optuna trial is not running any more.

        Such a run belonged to a process that died (killed, out of memory, power loss): Optuna's
        heartbeat marked the trial FAIL and queued a retry. The run becomes KILLED with a
        ``killed_reason`` tag. A process can also die between closing its run and Optuna storing
        the result: that run says COMPLETE while its trial failed and is retried, so it is turned
        KILLED too. Returns the closed run ids.
        """
        from optuna.trial import TrialState

        tag = hide_password(storage)
        # Trials first, runs second: a worker closes a trial's run before Optuna marks the trial
        # finished, so a trial still RUNNING in this snapshot protects a run that ends meanwhile,
        # and a finished trial's run is already closed when the runs are read. (The other order
        # killed runs that finished between the two reads.)
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        runs = self._call(self.client.search_runs, [self.experiment_id],
                      filter_string=f"tags.kind = '{KIND_TRIAL}' and attributes.status = 'RUNNING'",
                      max_results=5000)
        mine = [r for r in runs if r.data.tags.get("study_name") == study.study_name
                and r.data.tags.get("storage") == tag]
        retried = {}
        for t in trials.values():
            for n in t.system_attrs.get("retry_history", []):
                retried[n] = t.number
        closed = self._settle_killed_after_close(trials, retried)
        for run in mine:
            number = int(run.data.tags.get("trial_number", -1))
            trial = trials.get(number)
            if trial is not None and trial.state in (TrialState.RUNNING, TrialState.WAITING):
                continue
            if trial is not None and trial.user_attrs.get("mlflow_run_id") not in (None, run.info.run_id):
                state = "superseded"
            else:
                state = trial.state.name if trial is not None else "missing"
            reason = f"its process ended before the run was closed; Optuna trial {number} is {state}"
            if number in retried:
                reason += f" (retried as trial {retried[number]})"
            self._call(self.client.set_tag, run.info.run_id, "killed_reason", reason)
            self._call(self.client.set_tag, run.info.run_id, "trial_state", "KILLED")
            self._call(self.client.set_terminated, run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
        return closed

    def _settle_killed_after_close(self, trials: Mapping[int, Any], retried: Mapping[int, int]) -> list[str]:
        """KILLED for the runs of retried trials that still say COMPLETE (each trial checked once)."""
        from mlflow.exceptions import MlflowException
        from optuna.trial import TrialState

        closed = []
        for number, t in trials.items():
            run_id = t.user_attrs.get("mlflow_run_id")
            if (t.state != TrialState.FAIL or t.user_attrs.get("error") or not run_id or number not in retried
                    or run_id in self._settled):
                continue
            self._settled.add(run_id)
            try:
                run = self.client.get_run(run_id)
            except MlflowException:  # logged to another MLflow store
                continue
            if run.info.status == "FINISHED" and run.data.tags.get("trial_state") == "COMPLETE":
                reason = (f"its process died after closing the run but before Optuna stored the result; "
                          f"Optuna trial {number} is FAIL (retried as trial {retried[number]})")
                self._call(self.client.set_tag, run_id, "killed_reason", reason)
                self._call(self.client.set_tag, run_id, "trial_state", "KILLED")
                self._call(self.client.set_terminated, run_id, "KILLED")
                closed.append(run_id)
        return closed


class TrialRun:
    """The nested MLflow run of one trial."""

    def __init__(self, tracker: Tracker, run_id: str) -> None:
        self.client, self.run_id, self._call = tracker.client, run_id, tracker._call
        self.closed = False

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._call(self.client.log_batch, self.run_id, params=items[i:i + 100])

    def log_policy(self, policy: PolicyConfig) -> None:
        """Flat params, ``policy_hash`` tag and the ``policy.json`` artifact."""
        self.log_params(policy.flat())
        self._call(self.client.set_tag, self.run_id, "policy_hash", policy.config_hash())
        self._call(self.client.log_text, self.run_id, policy.canonical_json(), "policy.json")

    def log_provenance(self, provenance: Mapping[str, Any]) -> None:
        """Tags ``provenance.*`` (commit, versions, device, dtype, plug-ins with their hashes) and
        the whole record as ``provenance.json`` (see :mod:`dlm_toolkit.sweep.provenance`)."""
        tags = {f"provenance.{k}": str(v) for k, v in provenance.items() if k != "plugins" and v is not None}
        tags["provenance.plugins"] = " ".join(f"{p['class']}@{(p['sha256'] or '')[:12]}" for p in provenance["plugins"])
        from mlflow.entities import RunTag

        self._call(self.client.log_batch, self.run_id, tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
        self._call(self.client.log_text, self.run_id, json.dumps(provenance, indent=1), "provenance.json")

    def log_running(self, n_done: int, metrics: Mapping[str, float]) -> None:
        self._call(self.client.log_metric, self.run_id, "progress.accuracy_so_far", float(metrics["accuracy"]), step=n_done)

    def log_records(self, records: list[dict[str, Any]]) -> None:
        text = "\n".join(json.dumps(r, default=str) for r in records) + "\n"
        self._call(self.client.log_text, self.run_id, text, "records.jsonl")

    def log_trajectories(self, model: Any, tokenizer: Any, task: Any, policy: Any, seed: int, n_prompts: int = 2,
                         cuda_graphs: bool | None = None, label: str | None = None,
                         checkpoint: str | None = None) -> str | None:
        """The step-by-step viewer of ``n_prompts`` eval instances decoded again, recorded (the trial's
        evaluation keeps no trajectory), as the artifact ``trajectory.html``, named by the run's tag
        ``trajectory_html`` and linked from its description. Returns the artifact path, or None
        when the page cannot be made (the reason goes to the tag ``trajectory_html_error``: a
        trial is never failed by its picture). The page's title names the task, ``label`` (e.g. the
        trial and its parameters; default: the policy's hash) and the checkpoint."""
        from dlm_toolkit.models.chat import use_chat
        from dlm_toolkit.decoding.loop import decode
        from dlm_toolkit.evaluation.evaluate import task_prompt
        from dlm_toolkit.step.state import row_seed
        from dlm_toolkit.viewer import fit_every, page_title, trajectory_page

        try:
            instances = task.instances(n_prompts, seed, "eval")
            chat = use_chat(tokenizer, task.chat, "chat")
            prompts = [task_prompt(tokenizer, task, inst, chat) for inst in instances]
            result = decode(model, prompts, policy, task.answer_length + 1, record=True, cuda_graphs=cuda_graphs,
                            seed=[row_seed(seed, i) for i in range(len(prompts))])  # the evaluation's streams
            title = page_title(task.name, label or f"policy {policy.config_hash()[:12]}", None, checkpoint)
            page = trajectory_page(result, tokenizer, every=fit_every(result), title=title)
        except Exception as err:  # the trial's metrics stand; only its picture is missing
            self._call(self.client.set_tag, self.run_id, "trajectory_html_error", f"{type(err).__name__}: {err}"[:5000])
            return None
        self._call(self.client.log_text, self.run_id, page, "trajectory.html")
        note = (f"Step-by-step decode of {len(prompts)} eval instances: artifact [trajectory.html]"
                f"(get-artifact?path=trajectory.html&run_uuid={self.run_id})")
        before = self._call(self.client.get_run, self.run_id).data.tags.get("mlflow.note.content")
        note = f"{before}\n\n{note}" if before else note  # the trial's description stays first
        self._call(self.client.log_batch, self.run_id, tags=[_tag("trajectory_html", "trajectory.html"),
                                                             _tag("mlflow.note.content", note)])
        return "trajectory.html"

    def finish(self, status: str, trial_state: str, metrics: Mapping[str, float] | None = None,
               tags: Mapping[str, Any] | None = None) -> None:
        """Log final metrics/tags and terminate (FINISHED, FAILED or KILLED)."""
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if isinstance(v, (int, float))]
        ts = [RunTag("trial_state", trial_state)] + [RunTag(k, str(v)[:5000]) for k, v in (tags or {}).items()]
        self._call(self.client.log_batch, self.run_id, metrics=ms, tags=ts)
        self._call(self.client.set_terminated, self.run_id, status)
        self.closed = True


def _tag(key: str, value: str) -> Any:
    from mlflow.entities import RunTag

    return RunTag(key, value)


# -- single evaluations ------------------------------------------------------------------------
def log_eval_run(
    result: Any,
    policy: PolicyConfig,
    task: str,
    checkpoint: str | Path,
    tracking_uri: str,
    experiment_name: str = "dlm-eval",
    *,
    seed: int | None = None,
    n: int | None = None,
    run_name: str | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> str:
    """Log one :class:`~dlm_toolkit.evaluation.evaluate.EvalResult` as a run; returns its run id.

    Params: the policy's flat keys (+ ``task``, ``n``, ``seed``); metrics: ``result.metrics``;
    tags: ``policy_hash``, ``task``, ``checkpoint``, ``seed``, ``dlm_toolkit_version``,
    ``kind=eval``, ``provenance.*``; artifacts: ``policy.json``, ``provenance.json`` and
    ``records.jsonl`` (one line per instance).
    """
    tracker = Tracker(tracking_uri, experiment_name)
    tags = {"mlflow.runName": run_name or f"eval-{task}-{policy.config_hash()}", "kind": KIND_EVAL,
            "task": task, "checkpoint": checkpoint if str(checkpoint).startswith("oracle:") else str(Path(checkpoint).resolve()), "dlm_toolkit_version": _version(),
            "policy_hash": policy.config_hash()}
    if seed is not None:
        tags["seed"] = str(seed)
    run = tracker._call(tracker.client.create_run, tracker.experiment_id, run_name=tags["mlflow.runName"], tags=tags)
    trial = TrialRun(tracker, run.info.run_id)
    try:
        trial.log_params({**policy.flat(), "task": task, **({"n": n} if n is not None else {}),
                          **({"seed": seed} if seed is not None else {})})
        tracker._call(tracker.client.log_text, run.info.run_id, policy.canonical_json(), "policy.json")
        if provenance is not None:
            trial.log_provenance(provenance)
        if getattr(result, "records", None):
            trial.log_records(result.records)
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        tracker._call(tracker.client.log_batch, run.info.run_id,
                      metrics=[Metric(k, float(v), now, 0) for k, v in result.metrics.items()])
        tracker._call(tracker.client.set_terminated, run.info.run_id, "FINISHED")
    except BaseException:
        tracker._call(tracker.client.set_terminated, run.info.run_id, "FAILED")
        raise
    return run.info.run_id
