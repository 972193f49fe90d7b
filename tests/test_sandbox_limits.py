"""The uid pool behind per-run limits: leases exclusive across processes, freed when their holder
dies, and every process of a uid killed when its lease ends (root only: the pool needs setuid)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dlm_toolkit.tasks.sandbox import limits



def not_root() -> bool:
    """The pool needs setuid. A non-root run checks the documented alternative instead (no pool;
    runs share the user's uid, and sandbox_info says so) rather than skipping."""
    if os.geteuid() == 0:
        return False
    from dlm_toolkit.tasks.sandbox import sandbox_info

    assert not sandbox_info().per_run_uid
    with pytest.raises(limits.PoolUnavailable):
        with limits.uid_lease():
            pass
    return True

HOLDER = """
import sys
from dlm_toolkit.tasks.sandbox import limits
limits.POOL_FIRST, limits.POOL_SIZE = {first}, {size}
with limits.uid_lease() as uid:
    print(uid, flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def small_pool(monkeypatch):
    """A pool of three uids far from the real one, so concurrent test runs never collide."""
    first = limits.POOL_FIRST + limits.POOL_SIZE + 7000 + os.getpid() % 1000 * 3
    monkeypatch.setattr(limits, "POOL_FIRST", first)
    monkeypatch.setattr(limits, "POOL_SIZE", 3)
    limits._reserved.cache_clear()
    yield first
    limits._reserved.cache_clear()


def test_leases_are_exclusive_across_processes_and_end_with_their_holder(small_pool):
    if not_root():
        return
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(first=small_pool, size=3)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = int(holder.stdout.readline())
        with limits.uid_lease() as a, limits.uid_lease() as b:
            assert len({held, a, b}) == 3 and {held, a, b} == set(range(small_pool, small_pool + 3))
            with pytest.raises(limits.PoolUnavailable, match="all 3 sandbox uids"):
                with limits.uid_lease():
                    pass
            holder.kill()  # dies holding its lease: the kernel drops the lock
            holder.wait()
            with limits.uid_lease() as c:
                assert c == held
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_lease_ends_by_killing_everything_still_running_under_its_uid(small_pool):
    if not_root():
        return
    with limits.uid_lease() as uid:
        # a process that left its session and would outlive a process-group kill
        stray = subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[], start_new_session=True)
        assert limits.count_tasks(uid) == 1
    assert stray.wait(timeout=5) == -9
    assert limits.count_tasks(uid) == 0


def test_uids_the_machine_uses_are_never_leased(small_pool, monkeypatch):
    if not_root():
        return
    import functools

    monkeypatch.setattr(limits, "_reserved", functools.lru_cache(lambda: frozenset({small_pool, small_pool + 2})))
    for _ in range(5):  # the start is random: every start must skip the reserved two
        with limits.uid_lease() as uid:
            assert uid == small_pool + 1


def test_reserved_ids_come_from_accounts_groups_and_subordinate_ranges(tmp_path, monkeypatch):
    if not_root():
        return
    import pwd

    limits._reserved.cache_clear()
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
        monkeypatch.setattr(limits, "POOL_FIRST", nobody - 1)
        monkeypatch.setattr(limits, "POOL_SIZE", 3)
        assert nobody in limits._reserved()
    finally:
        limits._reserved.cache_clear()


def test_the_lock_folder_must_belong_to_root(tmp_path, monkeypatch):
    if not_root():
        return
    folder = tmp_path / "locks"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    monkeypatch.setattr(limits, "lock_dir", lambda: folder)
    with pytest.raises(limits.PoolUnavailable, match="writable only by it"):
        with limits.uid_lease():
            pass
    os.chmod(folder, 0o700)
    os.chown(folder, 12345, 12345)
    with pytest.raises(limits.PoolUnavailable, match="owned by root"):
        with limits.uid_lease():
            pass


def test_counting_reads_the_real_uid(small_pool):
    if not_root():
        return
    with limits.uid_lease() as uid:
        # setuid() without an exec: non-dumpable (its /proc entry root's) unless fs.suid_dumpable is 1
        code = f"import os, time\nos.setgroups([])\nos.setgid({uid})\nos.setuid({uid})\ntime.sleep(30)\n"
        proc = subprocess.Popen([sys.executable, "-c", code])
        try:
            deadline = time.monotonic() + 5
            while limits.count_tasks(uid) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert limits.tasks_of(uid) == {proc.pid: 1}
        finally:
            proc.kill()
            proc.wait()
