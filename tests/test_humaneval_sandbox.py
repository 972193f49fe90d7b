"""HumanEval task + sandbox: canonical solutions pass, wrong and malicious completions fail."""

from __future__ import annotations

import os
import random
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from dlm_toolkit.tasks import HumanEvalTask, Instance, get_task
from dlm_toolkit.tasks.sandbox import run_python, sandbox_info


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    t = get_task("humaneval", timeout_s=3.0, memory_mb=512)
    assert isinstance(t, HumanEvalTask)
    return t


@pytest.fixture(scope="module")
def problems(task: HumanEvalTask) -> list[Instance]:
    return task.instances(164, seed=0, split="eval")


@pytest.fixture(scope="module")
def first(problems: list[Instance]) -> Instance:
    return problems[0]


def _live_processes_with(marker: str) -> list[int]:
    """Pids of non-zombie processes whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            found.append(int(name))
    return found


def _assert_no_survivors(marker: str) -> None:
    deadline = time.monotonic() + 3.0
    while _live_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _live_processes_with(marker) == []


# ----------------------------------------------------------------------------- the task
def test_instances(task: HumanEvalTask, problems: list[Instance]) -> None:
    assert len(problems) == 164
    assert len({p.meta["task_id"] for p in problems}) == 164
    assert len(task.instances(500, seed=0, split="eval")) == 164
    sub = task.instances(10, seed=1, split="eval")
    assert [p.meta["task_id"] for p in sub] == [
        p.meta["task_id"] for p in task.instances(10, seed=1, split="eval")
    ]
    assert sub != task.instances(10, seed=2, split="eval")
    with pytest.raises(ValueError, match="eval"):
        task.instances(5, seed=0, split="train")
    assert all(task.split_of(p) == "eval" for p in sub)
    assert get_task("humaneval").answer_length == 512
    assert get_task("humaneval", answer_length=768).answer_length == 768


def test_all_canonical_solutions_pass(task: HumanEvalTask, problems: list[Instance]) -> None:
    start = time.perf_counter()
    scores = task.score_batch(problems, [p.reference for p in problems], workers=2)
    elapsed = time.perf_counter() - start
    failed = [p.meta["task_id"] for p, s in zip(problems, scores) if s != 1.0]
    assert failed == []
    assert elapsed < 60, f"164 canonical runs took {elapsed:.1f}s"


def test_wrong_completions_fail(task: HumanEvalTask, problems: list[Instance]) -> None:
    scores = task.score_batch(problems, ["    return None\n"] * len(problems), workers=2)
    assert sum(scores) == 0.0
    subset = random.Random(0).sample(problems, 40)
    assert sum(task.score_batch(subset, ["    pass\n"] * len(subset), workers=2)) == 0.0


def test_syntax_error_and_early_exit_fail(task: HumanEvalTask, first: Instance) -> None:
    assert task.score(first, "    return (\n") == 0.0
    # Exiting "successfully" before the tests run must not count as a pass.
    for body in ("    import sys\n    sys.exit(0)\n", "    raise SystemExit(0)\n"):
        prog = first.prompt + "    return True\n" + body.replace("    ", "") + "\n"
        assert not run_python(prog).passed
    res = run_python("import os\nos._exit(0)\n")
    assert not res.passed and "disabled" in res.stderr_tail


# ----------------------------------------------------------------------------- malicious code
def test_infinite_loop_is_killed(first: Instance) -> None:
    task = HumanEvalTask(timeout_s=1.0)
    start = time.perf_counter()
    res = task.run(first, "    while True:\n        pass\n")
    assert time.perf_counter() - start < 4.0
    assert res.timed_out and not res.passed and res.returncode is not None and res.returncode < 0
    assert task.score(first, "    import time\n    time.sleep(60)\n") == 0.0


def test_fork_bomb_fails_fast(task: HumanEvalTask, first: Instance) -> None:
    start = time.perf_counter()
    res = task.run(first, "    import os\n    while True:\n        os.fork()\n")
    assert not res.passed and not res.timed_out
    assert "PermissionError" in res.stderr_tail
    assert time.perf_counter() - start < 3.0


def test_child_process_cannot_be_spawned_or_outlive(task: HumanEvalTask, first: Instance) -> None:
    marker = f"dlm-sandbox-test-{uuid.uuid4().hex}"
    spawn = (
        "    import subprocess, sys\n"
        f"    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "    return False\n"
    )
    assert task.score(first, spawn) == 0.0
    via_os = f"    import os\n    os.system('sleep 60 # {marker}')\n    return False\n"
    assert task.score(first, via_os) == 0.0
    _assert_no_survivors(marker)


def test_process_group_is_killed_even_without_prelude() -> None:
    """OS-level layer: children (and orphaned grandchildren) die when the code ends."""
    marker = f"dlm-sandbox-test-{uuid.uuid4().hex}"
    code = (
        "import os, subprocess, sys, time\n"
        f"sleeper = [sys.executable, '-c', 'import time; time.sleep(60)', '{marker}']\n"
        "subprocess.Popen(sleeper)\n"
        "if os.fork() == 0:\n"  # double fork: the grandchild is orphaned
        "    subprocess.Popen(sleeper)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
    )
    res = run_python(code, guard=False)
    assert res.passed, res.stderr_tail
    _assert_no_survivors(marker)
    # ... and on timeout as well.
    res = run_python(code + "time.sleep(60)\n", guard=False, timeout_s=1.0)
    assert res.timed_out and not res.passed
    _assert_no_survivors(marker)


def test_unguarded_fork_bomb_is_contained() -> None:
    marker = f"dlm-sandbox-test-{uuid.uuid4().hex}"
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(48):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        f"        os.execv('/bin/sleep', ['{marker}', '60'])\n"
        "    n += 1\n"
        "print('forked', n)\n"
    )
    res = run_python(code, guard=False, max_processes=8, timeout_s=5.0)
    assert res.passed, res.stderr_tail
    forked = int(res.stdout_tail.split()[-1])
    if sandbox_info().nproc_limited:
        assert forked < 8
    else:
        assert forked == 48
    _assert_no_survivors(marker)


def test_memory_hog_is_killed(first: Instance) -> None:
    task = HumanEvalTask(timeout_s=5.0, memory_mb=256)
    hogs = [
        "    x = []\n    while True:\n        x.append(bytearray(10**7))\n",
        "    x = bytearray(8 * 1024**3)\n    return x\n",
    ]
    for body in hogs:
        start = time.perf_counter()
        res = task.run(first, body)
        assert not res.passed and not res.timed_out
        assert "MemoryError" in res.stderr_tail
        assert time.perf_counter() - start < 4.0


def test_socket_connect_fails(first: Instance) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        body = (
            "    import socket\n"
            "    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
            f"    s.connect(('127.0.0.1', {port}))\n"
            "    s.sendall(b'leak')\n"
            "    return True\n"
        )
        task = HumanEvalTask(timeout_s=3.0)
        assert task.score(first, body) == 0.0
        bypass = body.replace("import socket\n", "import _socket as socket\n")
        assert task.score(first, bypass) == 0.0
        create = f"    import socket\n    socket.create_connection(('127.0.0.1', {port}))\n"
        assert task.score(first, create) == 0.0
        # Without the prelude, a network namespace (when available) still blocks it.
        res = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
            guard=False,
        )
        assert res.passed == (not sandbox_info().network_namespace)
        if sandbox_info().network_namespace:
            with pytest.raises(BlockingIOError):
                server.accept()
    finally:
        server.close()


# ----------------------------------------------------------------------------- hygiene
def test_environment_stdin_tmpdir_and_output_cap() -> None:
    res = run_python("import os\nprint(os.getcwd())\nprint(sorted(os.environ))\n")
    assert res.passed
    cwd_line, env_line = res.stdout_tail.strip().splitlines()
    assert not Path(cwd_line).exists()  # temporary directory deleted afterwards
    assert set(eval(env_line)) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "LC_CTYPE"}
    start = time.perf_counter()
    assert not run_python("input()\n", timeout_s=5.0).passed  # EOF at once, no hang
    assert time.perf_counter() - start < 2.0
    flood = run_python("import sys\nfor _ in range(100000):\n    sys.stdout.write('x' * 100)\n",
                       output_limit_bytes=1 << 16)
    assert not flood.passed and len(flood.stdout_tail) <= 4000


def test_privileges_match_reported_isolation() -> None:
    res = run_python("import os\nprint(os.getuid())\n")
    assert res.passed
    uid = int(res.stdout_tail)
    info = sandbox_info()
    if info.drops_privileges:
        assert uid != 0 and os.geteuid() == 0
    else:
        assert uid == os.geteuid()
    assert sandbox_info(sys.executable) is sandbox_info(sys.executable)  # cached probe
