"""Throw-away real servers for tests: a PostgreSQL cluster and an ``mlflow server`` on top of it.

Both listen on 127.0.0.1 on free ports, live in a temp folder and are stopped (process group
killed, folder removed) on exit. PostgreSQL refuses to run as root, so as root the cluster runs
as the ``postgres`` user (Debian's package creates it).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def postgres_bin() -> Path | None:
    """The folder holding ``initdb`` and ``postgres``, or None if PostgreSQL is not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    return Path(os.path.realpath(which)).parent if which else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, what: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what} did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


@contextmanager
def postgres_server(databases: tuple[str, ...] = ("optuna", "mlflow")) -> Iterator[str]:
    """Start a cluster with ``databases`` in a new folder under the system temp folder (pytest's
    own is private to root, which the ``postgres`` user cannot enter); yields
    ``postgresql://dlm@127.0.0.1:PORT``."""
    import psycopg

    binaries = postgres_bin()
    assert binaries is not None, "PostgreSQL is not installed (apt-get install postgresql)"
    folder = Path(tempfile.mkdtemp(prefix="dlm-postgres-"))
    as_user: dict = {}
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(folder, entry.pw_uid, entry.pw_gid)
        as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    data, log = folder / "data", folder / "postgres.log"
    subprocess.run([str(binaries / "initdb"), "-D", str(data), "-U", "dlm", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, cwd=folder, **as_user)
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(binaries / "postgres"), "-D", str(data), "-k", str(folder), "-p", str(port),
                                 "-h", "127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off",
                                 "-c", "max_connections=200"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True, **as_user)
    url = f"postgresql://dlm@127.0.0.1:{port}"
    try:
        _wait(lambda: psycopg.connect(f"{url}/postgres", connect_timeout=2).close() is None, "postgres", proc, log)
        with psycopg.connect(f"{url}/postgres", autocommit=True) as conn:
            for name in databases:
                conn.execute(f"CREATE DATABASE {name}")
        yield url
    finally:
        _stop(proc, signal.SIGINT)  # PostgreSQL's fast shutdown (SIGTERM waits for every client)
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def mlflow_server(backend_uri: str, folder: Path) -> Iterator[str]:
    """``mlflow server`` with ``backend_uri`` and artifacts served from ``folder/artifacts``;
    yields ``http://127.0.0.1:PORT``."""
    folder.mkdir(parents=True, exist_ok=True)
    port, log = free_port(), folder / "mlflow-server.log"
    mlflow = Path(sys.executable).with_name("mlflow")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", backend_uri,
                                 "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1",
                                 "--port", str(port), "--workers", "1"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=folder, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: urllib.request.urlopen(f"{url}/health", timeout=2).status == 200, "mlflow server", proc, log)
        yield url
    finally:
        _stop(proc)
