"""Before ``dlm train`` does any work: check where it will write, and claim that folder.

:func:`check_destination` refuses, in one line, an ``--out`` whose nearest existing ancestor is not
a writable folder (a path below a regular file would otherwise fail at the first write, after
every training step) and a file system without room for the largest thing the run will write
(the final checkpoint, or a resume point: weights plus AdamW's two moments).

:func:`claim` makes one run the owner of ``--out`` for its whole life: an exclusive ``flock`` on
``OUT/.dlm-train.lock``, taken without waiting. A second run into the same folder is refused at
once, naming the folder and the run that holds it (host, pid, start time, from the lock file).
The kernel drops the lock when its process dies, however it dies, so a killed run never leaves a
stale claim; the file itself is removed when the run ends. Removing a lock file races with a
process that opened it just before: the claimant therefore checks, once it holds the lock, that
the path still names the file it locked, and starts over if not.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dlm_toolkit.config import ConfigError

LOCK_NAME = ".dlm-train.lock"
SLACK_BYTES = 4 << 20  # tokenizer files, training.json, the loss curve, file-system overhead


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (``lexists``: a dangling link counts)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_destination(out: Path, need_bytes: int) -> None:
    """Refuse an ``out`` that cannot be created or written, or whose file system has less than
    ``need_bytes`` (+ :data:`SLACK_BYTES`) free.

    Raises:
        ConfigError: ``out: ...`` naming the path in the way, or the free and needed space.
    """
    out = Path(out)
    base = nearest_existing(out)
    if not base.is_dir() and base == Path(os.path.abspath(out)):
        raise ConfigError(f"out: {out} exists and is not a folder")
    if not base.is_dir():
        what = "is not a folder" if base.exists() else "is a broken link"
        raise ConfigError(f"out: {out} cannot be created: {base} {what}")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"out: {out} cannot be written: no write permission in {base}")
    try:
        free = shutil.disk_usage(base).free
    except OSError as err:
        raise ConfigError(f"out: cannot read the free space of {base} ({err.strerror})") from None
    need = need_bytes + SLACK_BYTES
    if free < need:
        raise ConfigError(f"out: {base} has {_mb(free)} free; this run writes up to {_mb(need)} "
                          "(the checkpoint or a resume point); free space or choose another --out")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def checkpoint_bytes(n_params: int, save_bytes_per_param: int, resume_points: bool) -> int:
    """The most this run holds on disk at once beyond what ``out`` already has: the final weights
    (``save_bytes_per_param`` each), or a resume point (float32 weights and two AdamW moments)
    while the previous one is still in place."""
    final = n_params * save_bytes_per_param
    resume = 2 * 3 * 4 * n_params if resume_points else 0
    return max(final, resume)


def _holder(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text(encoding="utf-8"))
        return (f"another dlm train (pid {int(info['pid'])} on {str(info['host'])[:64]}, started "
                f"{str(info['started'])[:32]})")
    except (OSError, ValueError, KeyError, TypeError):
        return "another dlm train"


@contextmanager
def claim(out: Path) -> Iterator[None]:
    """Own ``out`` for the ``with`` block (see the module doc); ``out`` is created if absent and
    removed again on the way out if this run created it and left nothing in it.

    Raises:
        ConfigError: another live run holds ``out``.
    """
    out = Path(out)
    created, up = [], Path(os.path.abspath(out))
    while not up.exists() and up != up.parent:  # the folders this call makes, deepest first
        created.append(up)
        up = up.parent
    lock = out / LOCK_NAME
    fd = -1
    try:
        for _ in range(100):  # the file was removed between our open and our lock: take the new one
            try:  # again each time: a run that made the folder removes it, empty, when it ends
                out.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"out: cannot create {out} ({err.strerror})") from None
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                fd = -1
                raise ConfigError(f"out: {out} is being written by {_holder(lock)}; wait for it to finish "
                                  "or choose another --out") from None
            try:  # the path must still name the file we locked, or a third run could lock its successor
                now, held = os.stat(lock, follow_symlinks=False), os.fstat(fd)
                same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
            fd = -1
        else:
            raise ConfigError(f"out: could not claim {out} (its lock file keeps changing)")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(info) + "\n").encode())
        yield
    finally:
        if fd >= 0:
            lock.unlink(missing_ok=True)  # while still locked: nobody can be holding it
            os.close(fd)
        for folder in created:
            try:
                folder.rmdir()  # only if empty: a refused run leaves nothing behind
            except OSError:
                break
