"""Optuna storage and study life cycle: open any SQLAlchemy URL (heartbeats, retries of dead
trials), create a study or resume it after checking its settings, load an existing one.

See :mod:`dlm_toolkit.sweep.study` for what a resumed sweep keeps and redoes.
"""

from __future__ import annotations

import json
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import InputFileError, parse_json
from dlm_toolkit.sweep.attrs import read_settings, write_settings
from dlm_toolkit.sweep.experiment import Experiment
from dlm_toolkit.sweep.params import make_pruner, make_sampler
from dlm_toolkit.sweep.uris import (OPTUNA_TABLES, check_sqlite_folder, check_store_kind, creation_lock, first_line,
                                   hide_password, sqlite_tables)

DEFAULT_STORAGE = "sqlite:///optuna.db"
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_HEARTBEAT = 10
DEFAULT_RECONNECT = 60.0  # seconds a worker waits for a storage that stopped answering
MAX_RETRY = 3


def open_storage(url: str, heartbeat_interval: int | None = DEFAULT_HEARTBEAT, grace_period: int | None = None) -> Any:
    """An Optuna ``RDBStorage`` for any SQLAlchemy URL, with heartbeat and retry of dead trials.

    Raises:
        ConfigError: a SQLite file in a missing folder, a missing database driver, an
            unreachable server, or any other failure to open the storage.
    """
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    check_sqlite_folder(url, "storage")
    check_store_kind(url, "storage", "optuna")
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
                          "e.g. pip install 'psycopg[binary]' for postgresql://") from None
    except Exception as err:
        raise ConfigError(f"storage {hide_password(url)!r}: cannot open: {first_line(err)}") from None


def new_sqlite_files(*urls: str) -> list[Path]:
    """The SQLite database files ``urls`` name that do not exist yet (a command may create them)."""
    from dlm_toolkit.sweep.uris import sqlite_file

    files = [sqlite_file(url) for url in urls]
    return [f for f in files if f is not None and not f.exists()]


def remove_unused(files: list[Path]) -> None:
    """Remove SQLite stores a failed command created and left without a trial or a run (with their
    journals), so a refused command leaves no empty store behind. A store that holds any trial or
    run, or that cannot be read as one, is kept."""
    import sqlite3

    for db in files:
        if not db.is_file():
            continue
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                used = any(con.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone() for t in ("trials", "runs")
                           if t in tables)
            finally:
                con.close()
        except sqlite3.Error:
            continue
        if not used:
            for suffix in ("", "-journal", "-wal", "-shm"):
                (db.parent / f"{db.name}{suffix}").unlink(missing_ok=True)


def load_study(storage: str | Any, study_name: str) -> Any:
    """An existing study (``ConfigError`` listing the storage's studies if there is none)."""
    import optuna

    if isinstance(storage, str):
        from dlm_toolkit.sweep.uris import sqlite_file

        check_sqlite_folder(storage, "storage")
        db = sqlite_file(storage)
        if db is not None and not db.exists():
            raise ConfigError(f"storage {storage!r}: database file {db} does not exist")
        if db is not None and not OPTUNA_TABLES <= sqlite_tables(db, "storage", storage):
            # opening it would create Optuna's tables in it: a refused read must write nothing
            raise ConfigError(f"storage {hide_password(storage)!r}: {db} holds no Optuna study "
                              f"({'an empty file' if db.stat().st_size == 0 else 'no Optuna tables'})")
    store = open_storage(storage, heartbeat_interval=None) if isinstance(storage, str) else storage
    where = hide_password(str(getattr(store, "url", storage)))
    try:
        study = optuna.load_study(study_name=study_name, storage=store)
        # Optuna decodes every attribute from JSON as it reads it: read them all now, so an attribute
        # nested 100,000 deep in a tampered store fails here with one line, not anywhere later.
        _ = study.user_attrs, study.get_trials(deepcopy=False)
    except KeyError:
        names = optuna.get_all_study_names(store)
        raise ConfigError(f"no study named {study_name!r} in {where} (studies: {', '.join(names) or 'none'})") from None
    except RecursionError:
        raise ConfigError(f"study {study_name!r} in {where}: an attribute holds JSON nested too deeply to read "
                          "(the store was not written by dlm sweep)") from None
    return study


def connection_errors() -> tuple[type[BaseException], ...]:
    """What a storage raises when its database stops answering (server down, network gone)."""
    import optuna
    import sqlalchemy.exc

    return (optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError,
            sqlalchemy.exc.InterfaceError)


def lost_connection(err: BaseException) -> BaseException | None:
    """The connection error behind ``err``, if any: Optuna sometimes re-raises it as another
    exception (its own clean-up after a failed ``tell`` fails the same way), so follow the chain."""
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, connection_errors()):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def root_line(err: BaseException) -> str:
    """The first line of the innermost error behind ``err``: Optuna wraps the database's own words
    ("database or disk is full") in a generic "An exception is raised during the commit"."""
    seen = 0
    while (err.__cause__ or err.__context__) is not None and seen < 20:
        err, seen = err.__cause__ or err.__context__, seen + 1
    return first_line(err)


@contextmanager
def quiet_storage_threads() -> Iterator[None]:
    """Optuna's heartbeat thread dies with a traceback when the storage fails; the sweep's own loop
    meets the same failure and reports it in one line, so such threads end silently."""
    import threading

    previous = threading.excepthook

    def hook(args: Any) -> None:
        if args.exc_value is not None and lost_connection(args.exc_value) is not None:
            return
        previous(args)

    threading.excepthook = hook
    try:
        yield
    finally:
        threading.excepthook = previous


class StorageLost(ConfigError):
    """The storage stopped answering and did not come back within the reconnect budget."""


MAX_SAME_FAILURES = 3  # the same storage error, with no trial finished in between, ends the sweep
_SAME_FAILURES: dict[tuple[str, str], tuple[str, int | None, int]] = {}


def _finished_trials(study: Any) -> int | None:
    """How many trials of ``study`` completed or were pruned; None when the storage does not
    answer even a read (then it is down, not full: the caller waits for it)."""
    from optuna.trial import TrialState

    try:
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False,
                                               states=(TrialState.COMPLETE, TrialState.PRUNED))
    except connection_errors():
        return None
    return len(trials)


def wait_for_storage(study: Any, url: str, err: BaseException, budget_s: float, echo: Any = None) -> None:
    """Poll the storage behind ``study`` until it answers again, for up to ``budget_s`` seconds.

    A storage that answers reads but fails the same way :data:`MAX_SAME_FAILURES` times in a
    row, with no trial finishing in between (a full disk, a read-only file), is not waited for.

    Raises:
        StorageLost: still unreachable, or failing the same way again and again; the message says
            what is kept and how to continue.
    """
    first = root_line(err)
    done = _finished_trials(study)
    key = (hide_password(url), study.study_name)
    last = _SAME_FAILURES.get(key)
    repeats = last[2] + 1 if last is not None and last[:2] == (first, done) else 1
    _SAME_FAILURES[key] = (first, done, repeats)
    if done is not None and repeats >= MAX_SAME_FAILURES:
        # it answers reads but fails every write the same way: a full disk, a read-only file
        raise StorageLost(f"storage {hide_password(url)!r} failed {repeats} times in a row with the same error "
                          f"({first}) and no trial finished in between; the {done} finished trials are stored. "
                          "Mend the storage (free space, write permission) and run the same command again")
    if echo is not None and repeats > 1:
        echo(f"storage {hide_password(url)!r} failed again ({first}); try {repeats} of {MAX_SAME_FAILURES}")
    elif echo is not None:
        echo(f"storage {hide_password(url)!r} stopped answering ({first}); retrying for up to {budget_s:.0f} s")
    deadline, delay = time.monotonic() + budget_s, 0.5
    while time.monotonic() < deadline:
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(2 * delay, 5.0)
        try:
            study._storage.get_study_id_from_name(study.study_name)  # a real round trip
            return
        except connection_errors():
            continue
    raise StorageLost(f"storage {hide_password(url)!r}: connection lost ({first}) and not back after "
                      f"{budget_s:.0f} s. Finished trials are stored; a trial that was running is retried "
                      "(same parameters) when the same command runs again")


@contextmanager
def optuna_quiet() -> Iterator[None]:
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

    with optuna_quiet():
        study = optuna.create_study(storage=storage, study_name=study_name, directions=exp.directions,
                                    sampler=make_sampler(exp), pruner=make_pruner(exp), load_if_exists=True)
    started = len(study.get_trials(deepcopy=False))
    if started:
        study.sampler = make_sampler(exp, 0, started)  # a resumed study: continue, do not replay
    if claim_study(study, exp):  # this process made the study's settings, in one transaction
        study.set_user_attr("dlm_toolkit_version", dlm_toolkit.__version__)
        with optuna_quiet():  # experimental in Optuna 5
            study.set_metric_names(list(exp.metric_names))
        return study
    stored = read_settings(study)
    if stored is None:
        if study.get_trials(deepcopy=False):
            raise ConfigError(f"study {study_name!r} already exists and was not created by `dlm sweep` "
                              "(no stored experiment settings); choose another --study-name")
        if [d.name.lower() for d in study.directions] != exp.directions:
            raise ConfigError(f"study {study_name!r} exists with directions "
                              f"{[d.name.lower() for d in study.directions]}; choose another --study-name")
        write_settings(study, exp.settings())
        study.set_user_attr("dlm_toolkit_version", dlm_toolkit.__version__)
        with optuna_quiet():  # experimental in Optuna 5
            study.set_metric_names(list(exp.metric_names))  # optuna-dashboard labels its axes with them
        return study
    now = exp.result_settings()
    old = {k: stored.get(k) for k in now}
    if json.dumps(old, sort_keys=True) != json.dumps(now, sort_keys=True):
        changed = [k for k in now if json.dumps(old[k], sort_keys=True) != json.dumps(now[k], sort_keys=True)]
        detail = "; ".join(f"{k}: {_short(old[k])} -> {_short(now[k])}" for k in changed)
        raise ConfigError(f"study {study_name!r} was created with different settings ({detail}); "
                          "resume it with the original experiment file or use another --study-name")
    if stored != exp.settings():  # operational settings (sampler, pruning, presets, ...) may change
        write_settings(study, exp.settings())
    return study


DIGEST_KEY = "dlm_toolkit:experiment_digest"


def experiment_digest(exp: Experiment) -> str:
    """SHA-256 of the settings that decide a trial's results (what two sweeps of one study must share)."""
    import hashlib

    return hashlib.sha256(json.dumps(exp.result_settings(), sort_keys=True).encode()).hexdigest()


class _Recorder:
    """Collects what :func:`write_settings` would set on a study (the attribute split stays there)."""

    def __init__(self) -> None:
        self.attrs: dict[str, Any] = {}

    def set_user_attr(self, key: str, value: Any) -> None:
        self.attrs[key] = value


class _Attrs:
    """A stand-in study with given user attributes, for :func:`stored_settings`."""

    def __init__(self, name: str, attrs: dict[str, Any]) -> None:
        self.study_name, self.user_attrs = name, attrs


def claim_study(study: Any, exp: Experiment, attempts: int = 50) -> bool:
    """Make ``exp`` the experiment of ``study`` if no sweep has: True when this call did.

    One storage transaction inserts the experiment's digest as a study system attribute -- the
    storage's unique key on (study, key) lets exactly one of several sweeps starting at once
    succeed, on one host or many -- and, in the same transaction, writes the settings. A study
    that already holds settings from before the digest existed gets the digest only if its
    result-relevant settings equal ``exp``'s. False means another sweep's settings are in place
    (or differ): the caller compares them and refuses or resumes. Storages without SQL tables
    (Optuna's in-memory one) fall back to the unlocked write.
    """
    import sqlalchemy
    from sqlalchemy.exc import IntegrityError, OperationalError

    from dlm_toolkit.sweep.attrs import stored_settings

    backend = getattr(study._storage, "_backend", study._storage)
    engine = getattr(backend, "engine", None)
    if engine is None:
        if read_settings(study) is None and not study.get_trials(deepcopy=False):
            write_settings(study, exp.settings())
            return True
        return False
    study_id = study._study_id
    recorder = _Recorder()
    write_settings(recorder, exp.settings())
    text = sqlalchemy.text
    for _ in range(attempts):
        try:
            with engine.begin() as con:
                # the write comes first: SQLite takes its write lock here, so the reads below see
                # everything a sweep that got here before us committed
                con.execute(text("INSERT INTO study_system_attributes (study_id, key, value_json) "
                                 "VALUES (:id, :key, :value)"),
                            {"id": study_id, "key": DIGEST_KEY, "value": json.dumps(experiment_digest(exp))})
                rows = con.execute(text("SELECT key, value_json FROM study_user_attributes WHERE study_id = :id"),
                                   {"id": study_id}).fetchall()
                try:
                    attrs = {key: parse_json(value, f"study {study.study_name!r}: attribute {key}")
                             for key, value in rows if key.startswith("experiment")}
                except InputFileError as err:
                    raise ConfigError(str(err)) from None
                stored = stored_settings(_Attrs(study.study_name, attrs))
                if stored is not None:
                    old = {k: stored.get(k) if isinstance(stored, dict) else None for k in exp.result_settings()}
                    if json.dumps(old, sort_keys=True) != json.dumps(exp.result_settings(), sort_keys=True):
                        raise _Differs
                    return False  # a study made before the digest: now it has one; resume it
                trials = con.execute(text("SELECT COUNT(*) FROM trials WHERE study_id = :id"), {"id": study_id}).scalar()
                if trials:
                    raise _Differs  # not a dlm sweep study: the caller says so
                for key, value in recorder.attrs.items():
                    con.execute(text("INSERT INTO study_user_attributes (study_id, key, value_json) "
                                     "VALUES (:id, :key, :value)"),
                                {"id": study_id, "key": key, "value": json.dumps(value)})
                return True
        except (IntegrityError, _Differs):  # another sweep claimed it first (or it differs): compare
            return False
        except OperationalError as err:  # "database is locked" past the busy timeout: try again
            if "locked" not in str(err):
                raise
            time.sleep(0.1)
    raise ConfigError(f"study {study.study_name!r}: the storage stayed locked while claiming the study")


class _Differs(Exception):
    """Roll the claim's transaction back: the study's settings are not ``exp``'s."""


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
