"""The memory cgroup of a run counts its tmpfs (issue 43): pages written to ``/tmp`` and the working
folder are charged to the group of the process that wrote them, so a run that fills its ``/tmp``
and then uses most of ``memory_mb`` must still fit. Were the tmpfs left out of the group's limit,
the same run would be killed by the out-of-memory killer."""

from __future__ import annotations

import os

import pytest

from dlm_toolkit.tasks.sandbox import run_python, sandbox_info
from dlm_toolkit.tasks.sandbox.cgroup import cgroup_base

MODES = {"bwrap": {}, "process": {"isolation": "process", "unsafe_exec": True}}

FILL_THEN_ALLOCATE = (  # /tmp and the working folder filled (files of 512 KiB: under RLIMIT_FSIZE), then
    "import errno\n"     # 120 MiB touched in the process itself
    "written = {}\n"
    "for folder in ('/tmp', '.'):\n"
    "    written[folder] = 0\n"
    "    while written[folder] < LIMIT:\n"
    "        try:\n"
    "            with open(f'{folder}/fill{written[folder]}', 'wb') as f:\n"
    "                f.write(b'x' * (512 << 10))\n"
    "        except OSError as err:\n"
    "            assert err.errno == errno.ENOSPC, err\n"
    "            break\n"
    "        written[folder] += 512 << 10\n"
    "block = bytearray(120 << 20)\n"
    "block[::4096] = b'1' * len(block[::4096])\n"
    "print('tmp', written['/tmp'], 'work', written['.'], flush=True)\n"
)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_full_tmpfs_plus_most_of_the_memory_fit_the_runs_cgroup(mode: str) -> None:
    """memory_mb 160, /tmp and working folder 48 MiB each: the group allows 160 + 48 + 48 + 2 MiB
    and the run uses about 48 + 48 + 120 MiB + the interpreter. Without the two tmpfs in the limit
    (162 MiB), or without either one (210 MiB), it is killed. Near miss beside it: the same run
    writing 1 MiB to each folder, which never needed the tmpfs's share."""
    if mode == "process" and (os.geteuid() != 0 or not sandbox_info("/usr/bin/python3").mount_namespace):
        return  # process mode needs root and a private /tmp (test_sandbox_hostile checks its refusal)
    kw = dict(timeout_s=30.0, memory_mb=160, tmp_mb=48, workdir_mb=48, guard=False, **MODES[mode])
    full = run_python("LIMIT = 1 << 40\n" + FILL_THEN_ALLOCATE, **kw)
    light = run_python("LIMIT = 1 << 20\n" + FILL_THEN_ALLOCATE, **kw)
    assert light.passed, light
    assert full.passed, full  # killed (-9 / 137) when the group's limit forgets a tmpfs
    tmp, work = (int(v) for v in full.stdout_tail.split()[1::2])
    assert 44 << 20 <= tmp <= 48 << 20 and 44 << 20 <= work <= 48 << 20, full.stdout_tail  # both really full
    if os.geteuid() == 0:
        assert cgroup_base() is not None, "root without a writable memory controller: the test cannot bite here"
