"""A memory cgroup per sandboxed process, where the evaluator may make one (root, a writable
memory controller): the memory of *all* the processes of a run together is bounded, which
``RLIMIT_AS`` (per process) cannot do.

A run's group is ``<our memory cgroup>/dlm-sandbox-<uid>`` (the leased uid names it: one run
holds it at a time; one an evaluator killed mid-run left is removed by the next evaluator
that starts, or reused by the next run under that uid). Its limit is the run's memory plus its two tmpfs and its captured output
(tmpfs pages are charged to the group that writes them), swap included where the kernel
accounts it. The sandboxed process joins it before any untrusted byte runs: process mode's
runner writes its own pid while still root; bubblewrap is started through a ``/bin/sh`` gate that
waits on a pipe until the harness has moved it in (everything it forks inherits the group).

cgroup v1's ``memory`` hierarchy and a cgroup v2 whose ``cgroup.subtree_control`` already
delegates ``memory`` to our group are used; anywhere else (not root, a read-only or missing
controller) :func:`cgroup_base` is ``None`` and the documented bound holds instead:
``max_processes`` x ``memory_mb`` (RLIMIT_NPROC x RLIMIT_AS).
"""

from __future__ import annotations

import functools
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass(frozen=True)
class CgroupBase:
    """Where runs' groups are made: ``version`` 1 or 2, ``path`` the parent folder."""

    version: int
    path: Path


def _mounts() -> list[tuple[str, str, str, str]]:
    """``(root, mount point, fstype, super options)`` of every mount (``/proc/self/mountinfo``)."""
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        left, _, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if len(a) >= 5 and len(b) >= 3:
            found.append((a[3], a[4], b[0], b[2]))
    return found


def _own_groups() -> dict[str, str]:
    """Our cgroup path per hierarchy: ``{"memory": "/x", "": "/y" (v2)}``."""
    groups = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return groups
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                groups[controller] = parts[2]
    return groups


def _under(mount: str, root: str, group: str) -> Path:
    rel = os.path.relpath(group, root) if group.startswith(root) else "."
    path = Path(mount) / rel
    return path if path.is_dir() else Path(mount)


@functools.lru_cache(maxsize=1)
def cgroup_base() -> CgroupBase | None:
    """Where this evaluator can make memory-limited groups, or ``None`` (probed once)."""
    if os.geteuid() != 0:
        return None
    groups = _own_groups()
    for root, mount, fstype, options in _mounts():
        if fstype == "cgroup2" and "" in groups:
            path = _under(mount, root, groups[""])
            try:
                delegated = "memory" in (path / "cgroup.subtree_control").read_text().split()
            except OSError:
                delegated = False
            if delegated and _writable(path, "memory.max"):
                return _swept(CgroupBase(2, path))
    for root, mount, fstype, options in _mounts():
        if fstype == "cgroup" and "memory" in options.split(",") and "memory" in groups:
            path = _under(mount, root, groups["memory"])
            if _writable(path, "memory.limit_in_bytes"):
                return _swept(CgroupBase(1, path))
    return None


def _swept(base: CgroupBase) -> CgroupBase:
    """``base`` after removing the groups an evaluator killed mid-run left (once per process): no
    one leases their uid, so what still runs in them is that dead run's."""
    from .limits import leased

    for group in base.path.glob("dlm-sandbox-*"):
        uid = group.name.rpartition("-")[2]
        if uid.isdigit() and not leased(int(uid)):
            _remove(group)  # what is still in it is the dead run's (dying with its evaluator)
    return base


def _writable(parent: Path, limit_file: str) -> bool:
    """A trial group under ``parent`` can be made, limited and removed."""
    trial = parent / f"dlm-sandbox-probe-{os.getpid()}"
    try:
        trial.mkdir()
    except OSError:
        return False
    try:
        (trial / limit_file).write_text(str(64 << 20))
        return True
    except OSError:
        return False
    finally:
        try:
            trial.rmdir()
        except OSError:
            pass


@contextmanager
def run_cgroup(name: str, limit_bytes: int) -> Iterator[str | None]:
    """A group limited to ``limit_bytes`` of memory (swap included where accounted) for one run;
    yields the path of its ``cgroup.procs`` (write a pid there to move it in), or ``None`` where
    no group can be made. The group is removed when the block ends (its processes are gone by
    then: the uid lease kills them)."""
    base = cgroup_base()
    if base is None:
        yield None
        return
    path = base.path / name
    try:
        path.mkdir(exist_ok=True)  # one left by a killed evaluator: the uid lease is ours now
        if base.version == 1:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            memsw = path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit_bytes))
        else:
            (path / "memory.max").write_text(str(limit_bytes))
            swap = path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
    except OSError:
        _remove(path)
        yield None
        return
    try:
        yield str(path / "cgroup.procs")
    finally:
        _remove(path)


def _remove(path: Path) -> None:
    """Kill what is still in the group (all of it the run's), then remove it."""
    deadline = time.monotonic() + 2.0
    while True:  # a killed process leaves its group a moment after it is reaped
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
        try:
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
