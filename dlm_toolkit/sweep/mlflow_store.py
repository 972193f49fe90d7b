"""The MLflow store a sweep, an evaluation or a training run logs to: opened once, one experiment in
it (created on first use, its artifacts beside a SQLite store), every client call retried through
SQLite lock errors and unique-key races, and a tracking server that stopped answering reported once
(:class:`TrackingLost`). The study and trial runs on top of it are :mod:`dlm_toolkit.sweep.tracking`'s.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, TypeVar

from dlm_toolkit.config import ConfigError
from dlm_toolkit.sweep.uris import (
    check_sqlite_folder,
    creation_lock,
    first_line,
    quiet_http,
    sqlite_file,
    store_relative_location,
)

T = TypeVar("T")

KIND_STUDY, KIND_TRIAL, KIND_EVAL = "study", "trial", "eval"

RUNS_VIEW_KEY = "dlm"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"
RUNS_VIEW = {  # columns and order of the runs table opened by runs_table_url()
    "selectedColumns": ["metrics.`accuracy`", "metrics.`tpf`", "metrics.`nfe_mean`", "tags.`trial_number`",
                        "tags.`preset`", "tags.`trial_state`"],
    "orderByKey": "metrics.`accuracy`",
    "orderByAsc": False,
}
"""The runs table as MLflow's "share view" stores it (an experiment tag ``mlflow.sharedViewState.<key>``,
opened by ``?viewStateShareKey=<key>``): MLflow offers no other way to choose a table's default columns,
and without it the table shows no metric at all until one clicks them in."""


def run_page_url(base: str, experiment_id: str, run_id: str) -> str:
    """A run's page in MLflow's machine-learning view (the default GenAI view hides runs)."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def runs_table_url(base: str, experiment_id: str) -> str:
    """The experiment's runs table (machine-learning view) with accuracy, TPF and NFE as columns, best
    accuracy first (checked in a browser: MLflow 3.17 shows "You're viewing a shared view")."""
    return (f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
            f"&viewStateShareKey={RUNS_VIEW_KEY}")


def _clash(err: BaseException) -> bool:
    """Two writers inserted the same row at once: MLflow's ``set_tag`` reads the tag, then inserts
    it when absent, so two workers tagging one run (``on_front`` at the end of their sweeps) can
    both insert; the loser gets a unique-key violation, and the same call again updates the row
    the winner wrote. An existing experiment name is a real conflict, not a race to retry."""
    text = str(err)
    if getattr(err, "error_code", None) == "RESOURCE_ALREADY_EXISTS":
        return False
    return any(s in text for s in ("IntegrityError", "UniqueViolation", "UNIQUE constraint failed",
                                   "duplicate key value violates unique constraint"))


def _retry(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call an MLflow client method, retrying SQLite lock errors and unique-key races (see
    :func:`_clash`) from concurrent workers; a clash is retried twice at most, since a row that
    still clashes is no race."""
    delay = 0.25
    clashes = 0
    for attempt in range(6):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            clash = _clash(err)
            clashes += clash
            if attempt == 5 or clashes > 2 or not (clash or "locked" in str(err).lower()):
                raise
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


class TrackingLost(ConfigError):
    """The MLflow tracking server stopped answering (after the MLflow client's own retries)."""


def _unreachable(err: BaseException) -> bool:
    """MLflow's REST client gave up on a request (refused, reset, timed out, or 5xx until its retries
    ran out); an answer from the server (bad request, not found) is not that."""
    from mlflow.exceptions import MlflowException

    text = str(err)
    return isinstance(err, MlflowException) and text.startswith("API request to ") and (
        " failed with exception " in text or " failed with timeout exception " in text)


def _version() -> str:
    import dlm_toolkit

    return dlm_toolkit.__version__


class MlflowStore:
    """An MLflow store plus one experiment in it (created on first use)."""

    def __init__(self, tracking_uri: str, experiment_name: str) -> None:
        from mlflow import MlflowClient

        check_sqlite_folder(tracking_uri, "tracking URI")
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        try:
            with quiet_http(), creation_lock(tracking_uri):
                self.client = MlflowClient(tracking_uri)
                exp = self.client.get_experiment_by_name(experiment_name)
        except Exception as err:
            raise ConfigError(f"tracking URI {tracking_uri!r}: cannot open the MLflow store: {first_line(err)}") from None
        self._settled: set[str] = set()  # run ids of killed trials already checked by reconcile
        self.lost: TrackingLost | None = None
        if exp is None:
            self.experiment_id = self._create_experiment(experiment_name)
        else:
            self.experiment_id = exp.experiment_id
        if exp is None or RUNS_VIEW_TAG not in exp.tags:
            self._call(self.client.set_experiment_tag, self.experiment_id, RUNS_VIEW_TAG, json.dumps(RUNS_VIEW))

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call an MLflow client method (SQLite lock errors retried). Once the tracking server has
        stopped answering, every later call raises the same :class:`TrackingLost` at once instead of
        waiting out MLflow's retries (minutes) again."""
        if self.lost is not None:
            raise self.lost
        try:
            return _retry(fn, *args, **kwargs)
        except Exception as err:
            if not _unreachable(err):
                raise
            self.lost = TrackingLost(
                f"tracking URI {self.tracking_uri!r}: the MLflow server stopped answering ({first_line(err)}); "
                "the trial in flight is marked failed and retried with the same parameters, finished trials are "
                "stored in the Optuna storage -- run the same command again once the server is back")
            raise self.lost from err

    def _create_experiment(self, name: str) -> str:
        """Artifacts of a SQLite store go next to the database (``mlartifacts/``), not into the cwd.

        A relative ``sqlite:///runs/mlflow.db`` gets a relative artifact location
        (``runs/mlartifacts/<name>``): both resolve against the folder the store is used from, so
        the store survives moving that folder. MLflow makes every location absolute on creation,
        hence the rewrite of the experiment's row right after it.
        """
        db = sqlite_file(self.tracking_uri)
        location = None
        if db is not None:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
            location = db.parent / "mlartifacts" / safe
        try:
            experiment_id = self._call(self.client.create_experiment, name,
                                       artifact_location=None if location is None else location.resolve().as_uri())
        except Exception:  # created concurrently by another worker
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id
        if location is not None and not location.is_absolute():
            store_relative_location(self.tracking_uri, experiment_id, location.as_posix())
        return experiment_id
