"""Limits that belong to one sandboxed process, whatever runs beside it: a uid of its own.

``RLIMIT_NPROC`` counts the processes of a *uid*, not of a process tree. When every sandbox ran
as ``nobody``, concurrent runs (``--workers K`` on ``humaneval``, the two sides of
:func:`.run_tests`) shared one budget: a fork bomb in one run ate the others' processes, and the
others' processes raised the limit it was given. So, as root, each sandboxed process gets a uid
of its own from a pool of unnamed, unprivileged uids (:data:`POOL_FIRST` ..
``POOL_FIRST + POOL_SIZE - 1``; uids and gids that ``/etc/passwd``, ``/etc/group``,
``/etc/subuid`` or ``/etc/subgid`` use are skipped), leased with an ``fcntl.flock`` on
``<lock dir>/<uid>.lock``: separate processes (sweep workers) and threads never hold the same
uid at once, and a lease ends with the process that held it, however it dies. Its
``RLIMIT_NPROC`` is then exactly ``max_processes`` -- bubblewrap's own processes included --
and when the lease ends every process still running under the uid is killed.

Why not cgroups: a per-run cgroup needs a writable cgroup tree (cgroup v2 delegation, or v1's
``pids`` hierarchy), which containers and CI runners often lack; setting a uid works wherever
the evaluator runs as root, which is where ``RLIMIT_NPROC`` was unenforceable before. A
non-root evaluator cannot change uids: its runs share its own uid's budget (the limit is its
current task count plus ``max_processes``), and :attr:`.SandboxInfo.per_run_uid` says so.

Memory (``RLIMIT_AS``) and CPU time (``RLIMIT_CPU``) are per process; with the process count
bounded, a run's total is at most ``max_processes`` times each.
"""

from __future__ import annotations

import fcntl
import functools
import grp
import os
import pwd
import random
import signal
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dlm_toolkit.config import ConfigError

POOL_FIRST = 200_000
POOL_SIZE = 1_000
_CLEAN = b"clean\n"  # written into a uid's lock file once nothing runs under it any more


class PoolUnavailable(ConfigError):
    """No uid could be leased (lock folder unsafe, or every uid in use): one line for the person
    running the evaluation (``dlm`` prints it and exits 2), as :class:`.probe.SandboxUnavailable`."""


def lock_dir() -> Path:
    """Where the lease locks live: root-only ``/run/dlm-toolkit-sandbox-uids`` (else the temp folder)."""
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    return base / "dlm-toolkit-sandbox-uids"


@functools.lru_cache(maxsize=1)
def _reserved() -> frozenset[int]:
    """Ids the machine uses for accounts, groups or subordinate id ranges (never leased)."""
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    last = POOL_FIRST + POOL_SIZE
    for table in ("/etc/subuid", "/etc/subgid"):
        try:
            lines = Path(table).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                start, count = int(parts[1]), int(parts[2])
                taken.update(range(max(start, POOL_FIRST), min(start + count, last)))
    return frozenset(u for u in taken if POOL_FIRST <= u < last)


def _open_lock_dir() -> Path:
    folder = lock_dir()
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError as err:
        raise PoolUnavailable(f"cannot create the uid lock folder {folder}: {err.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        # someone else made it: their locks could starve us or point elsewhere
        raise PoolUnavailable(f"{folder} must be a folder owned by root and writable only by it")
    return folder


@contextmanager
def uid_lease() -> Iterator[int]:
    """A pool uid (also used as the gid) that no other sandboxed process holds, until the block ends.

    Root only. On exit every process still running under the uid is killed.

    Raises:
        PoolUnavailable: the lock folder is not safe, or all :data:`POOL_SIZE` uids are leased.
    """
    folder = _open_lock_dir()
    reserved = _reserved()
    start = random.randrange(POOL_SIZE)  # spread concurrent leases over the pool
    for i in range(POOL_SIZE):
        uid = POOL_FIRST + (start + i) % POOL_SIZE
        if uid in reserved:
            continue
        fd = os.open(folder / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            if os.pread(fd, len(_CLEAN), 0) != _CLEAN:  # the last holder died holding it: clean up after it
                kill_uid(uid)
            os.ftruncate(fd, 0)
            yield uid
        finally:
            try:
                kill_uid(uid)
                os.pwrite(fd, _CLEAN, 0)
            finally:
                os.close(fd)  # releases the lock
        return
    raise PoolUnavailable(f"all {POOL_SIZE} sandbox uids ({POOL_FIRST}..{POOL_FIRST + POOL_SIZE - 1}) are in use by "
                          "other sandboxed runs; wait for them or run fewer at once (--workers)")


def leased(uid: int) -> bool:
    """Whether some process holds ``uid``'s lease now (a lock we could not take)."""
    try:
        fd = os.open(lock_dir() / f"{uid}.lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # never leased on this machine
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if we took it
    return False


def tasks_of(uid: int, live_only: bool = False) -> dict[int, int]:
    """``{pid: threads}`` of the processes whose real uid is ``uid`` (what ``RLIMIT_NPROC`` counts);
    ``live_only``: without zombies (they cannot be killed, only reaped by their parent).

    Reads ``/proc/<pid>/status``: a process that changed its uid without an exec is not dumpable
    (unless ``fs.suid_dumpable`` is 1), and then its ``/proc`` entry is owned by root."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        real = threads = None
        dead = False
        for line in status.splitlines():
            if line.startswith(b"Uid:"):
                real = int(line.split()[1])
            elif line.startswith(b"Threads:"):
                threads = int(line.split()[1])
            elif line.startswith(b"State:"):
                dead = line.split()[1] in (b"Z", b"X")
        if real == uid and not (live_only and dead):
            found[int(name)] = threads or 1
    return found


def count_tasks(uid: int) -> int:
    """Threads currently owned by ``uid``."""
    return sum(tasks_of(uid).values())


def kill_uid(uid: int, timeout_s: float = 2.0) -> None:
    """SIGKILL every process running as ``uid`` (a leased uid: they are all ours) and wait for them.

    Each target is pinned with a pidfd and its uid read again through it, so a recycled pid is never hit."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = tasks_of(uid, live_only=True)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if pid in tasks_of_one(pid, uid):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)
        time.sleep(0.005)


def tasks_of_one(pid: int, uid: int) -> set[int]:
    """``{pid}`` if ``pid`` still runs as ``uid`` (read after pinning it with a pidfd), else empty."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return {pid} if int(line.split()[1]) == uid else set()
    except OSError:
        pass
    return set()
