"""Store URLs and files: SQLAlchemy/SQLite URLs (passwords hidden, SQLite files found and locked)
and the tracking server's web addresses, shared by the Optuna storage and the MLflow tracking code."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

from dlm_toolkit.config import ConfigError, utf8_argument


def hide_password(url: str) -> str:
    """A SQLAlchemy URL with its password masked and, for SQLite, an absolute path.

    This is the ``storage`` tag that identifies a study's runs: ``sqlite:///optuna.db`` run from
    two folders are two different studies.
    """
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        if parsed.drivername.startswith("sqlite") and parsed.database and parsed.database != ":memory:":
            parsed = parsed.set(database=str(Path(parsed.database).resolve()))
        return parsed.render_as_string(hide_password=True)
    except Exception:  # not a SQLAlchemy URL: keep as is
        return url


def hide_web_password(url: str) -> str:
    """An http(s) address with the password of its user part masked and nothing else touched.

    Not :func:`hide_password`: SQLAlchemy's URL renderer percent-encodes what it does not know,
    and the ``#`` of MLflow's page addresses (``/#/experiments/1/runs/...``) then becomes ``%23``,
    a path the server answers with 404.
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///PATH`` URI (None for other schemes / in-memory)."""
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    db = make_url(uri).database
    return Path(db) if db and db != ":memory:" else None


def first_line(err: BaseException) -> str:
    """The first line of an error's message (driver errors run to many lines), else its type."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_utf8(uri: str, what: str) -> None:
    """Refuse a URL whose bytes were not UTF-8 (Python hands such command-line bytes over as lone
    surrogates, which SQLAlchemy and SQLite cannot encode: a traceback, later)."""
    utf8_argument(uri, what)


OPTUNA_TABLES = frozenset({"studies", "trials"})
MLFLOW_TABLES = frozenset({"experiments", "runs"})


def sqlite_tables(db: Path, what: str, uri: str) -> set[str]:
    """The tables of SQLite file ``db``, read without writing a byte (``mode=ro``).

    Raises:
        ConfigError: the file is not an SQLite database (or cannot be read).
    """
    import sqlite3
    from urllib.parse import quote

    try:
        con = sqlite3.connect(f"file:{quote(str(db.resolve()))}?mode=ro", uri=True)
        try:
            return {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error as err:
        raise ConfigError(f"{what} {hide_password(uri)!r}: {db} is not a readable SQLite database ({err})") from None


def check_store_kind(uri: str, what: str, kind: str) -> None:
    """Refuse an existing SQLite file that holds another store than ``kind`` (``"optuna"`` or
    ``"mlflow"``) -- typically ``--storage`` and ``--tracking-uri`` swapped -- before either
    library creates its tables in it. A missing or empty file is left to the caller."""
    db = sqlite_file(uri)
    if db is None or not db.is_file() or db.stat().st_size == 0:
        return
    with creation_lock(uri):  # not halfway through another process's schema creation
        tables = sqlite_tables(db, what, uri)
    want, other, names = ((OPTUNA_TABLES, MLFLOW_TABLES, ("an Optuna storage", "an MLflow tracking store"))
                          if kind == "optuna" else (MLFLOW_TABLES, OPTUNA_TABLES,
                                                    ("an MLflow tracking store", "an Optuna storage")))
    if not tables or want <= tables:
        return
    if other <= tables:
        raise ConfigError(f"{what} {hide_password(uri)!r}: {db} is {names[1]}, not {names[0]} "
                          "(--storage and --tracking-uri swapped?)")
    shown = ", ".join(sorted(tables)[:5]) + (" ..." if len(tables) > 5 else "")
    raise ConfigError(f"{what} {hide_password(uri)!r}: {db} is not {names[0]} (its tables: {shown})")


def check_sqlite_folder(uri: str, what: str) -> None:
    """A clear error for ``sqlite:///missing/folder/x.db`` (SQLite would say 'unable to open')."""
    check_utf8(uri, what)
    try:
        db = sqlite_file(uri)
    except Exception as err:
        raise ConfigError(f"{what} {uri!r}: not a valid database URL ({err})") from None
    if db is not None and not db.resolve().parent.is_dir():
        raise ConfigError(f"{what} {uri!r}: folder {db.resolve().parent} does not exist")


@contextmanager
def creation_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock on the folder of a SQLite store while opening it, so that creating
    or migrating the schema (MLflow's and Optuna's first use of a new file) happens in one process
    at a time; concurrent first users of one new store all succeed. The lock is an ``flock`` on
    the folder itself: nothing is written next to the store (a ``.lock`` file would be left beside
    any file a mistyped URL names). Other URLs: no lock (servers create their schema once, before
    the workers start)."""
    import fcntl

    db = sqlite_file(uri)
    if db is None:
        yield
        return
    fd = os.open(db.parent if str(db.parent) else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def store_relative_location(tracking_uri: str, experiment_id: str, location: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(tracking_uri)
    try:
        with engine.begin() as con:
            con.execute(sqlalchemy.text("UPDATE experiments SET artifact_location = :location WHERE experiment_id = :id"),
                        {"location": location, "id": int(experiment_id)})
    finally:
        engine.dispose()


@contextmanager
def quiet_http() -> Iterator[None]:
    """Fail fast on an unreachable tracking server while checking it (MLflow retries for minutes)."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "10"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
