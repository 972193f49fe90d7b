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


class PostgresCluster:
    """A throw-away cluster in a new folder under the system temp folder (pytest's own is private
    to root, which the ``postgres`` user cannot enter): :meth:`start`, :meth:`kill` (SIGKILL, as a
    crash), :meth:`start` again on the same data and port, :meth:`close`."""

    def __init__(self, databases: tuple[str, ...] = ("optuna", "mlflow")) -> None:
        binaries = postgres_bin()
        assert binaries is not None, "PostgreSQL is not installed (apt-get install postgresql)"
        self.bin, self.databases = binaries, databases
        self.folder = Path(tempfile.mkdtemp(prefix="dlm-postgres-"))
        self.as_user: dict = {}
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
            self.as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        self.data, self.log = self.folder / "data", self.folder / "postgres.log"
        subprocess.run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "dlm", "--auth=trust", "-E", "UTF8"],
                       check=True, capture_output=True, cwd=self.folder, **self.as_user)
        self.port = free_port()
        self.url = f"postgresql://dlm@127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()
        import psycopg

        with psycopg.connect(f"{self.url}/postgres", autocommit=True) as conn:
            for name in databases:
                conn.execute(f"CREATE DATABASE {name}")

    def start(self) -> None:
        import psycopg

        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.data), "-k", str(self.folder), "-p", str(self.port),
                 "-h", "127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.folder, start_new_session=True, **self.as_user)
        _wait(lambda: psycopg.connect(f"{self.url}/postgres", connect_timeout=2).close() is None, "postgres",
              self.proc, self.log)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        pid_file = self.data / "postmaster.pid"  # a crashed server leaves it; the next start checks it
        pid_file.unlink(missing_ok=True)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc, signal.SIGINT)  # PostgreSQL's fast shutdown (SIGTERM waits for every client)
        shutil.rmtree(self.folder, ignore_errors=True)


@contextmanager
def postgres_server(databases: tuple[str, ...] = ("optuna", "mlflow")) -> Iterator[str]:
    """A :class:`PostgresCluster` for the duration of the block; yields its ``postgresql://dlm@127.0.0.1:PORT``."""
    cluster = PostgresCluster(databases)
    try:
        yield cluster.url
    finally:
        cluster.close()


class MlflowServer:
    """``mlflow server`` with ``backend_uri`` and artifacts served from ``folder/artifacts``, on
    ``url`` (``http://127.0.0.1:PORT``): :meth:`start`, :meth:`kill` (SIGKILL), :meth:`start` again
    on the same port, :meth:`close`."""

    def __init__(self, backend_uri: str, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.backend_uri, self.folder = backend_uri, folder
        self.port, self.log = free_port(), folder / "mlflow-server.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", self.backend_uri,
                                          "--artifacts-destination", str(self.folder / "artifacts"),
                                          "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                                         stdout=out, stderr=subprocess.STDOUT, cwd=self.folder, env=env,
                                         start_new_session=True)
        _wait(lambda: urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200, "mlflow server",
              self.proc, self.log)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc)


@contextmanager
def mlflow_server(backend_uri: str, folder: Path) -> Iterator[str]:
    """A :class:`MlflowServer` for the duration of the block; yields its URL."""
    server = MlflowServer(backend_uri, folder)
    try:
        yield server.url
    finally:
        server.close()
