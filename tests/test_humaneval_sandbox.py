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
from dlm_toolkit.tasks.sandbox import SandboxUnavailable, run_python, sandbox_info
from dlm_toolkit.tasks.sandbox.limits import POOL_FIRST, POOL_SIZE


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
    """The one run of all 164 (time per problem: benchmarks/sandbox.py)."""
    scores = task.score_batch(problems, [p.reference for p in problems], workers=2)
    failed = [p.meta["task_id"] for p, s in zip(problems, scores) if s != 1.0]
    assert failed == []


def test_wrong_completions_fail(task: HumanEvalTask, problems: list[Instance]) -> None:
    subset = random.Random(0).sample(problems, 40)
    assert sum(task.score_batch(subset, ["    return None\n"] * len(subset), workers=2)) == 0.0
    subset = random.Random(1).sample(problems, 20)
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


PROCESS = {"isolation": "process", "unsafe_exec": True}  # the layers --unsafe-exec leaves


def test_process_group_is_killed_even_without_prelude() -> None:
    """Process layer: children (and orphaned grandchildren) die when the code ends."""
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
    for layers in (PROCESS, {}):  # and under bubblewrap
        res = run_python(code, guard=False, **layers)
        assert res.passed, res.stderr_tail
        _assert_no_survivors(marker)
        # ... and on timeout as well.
        res = run_python(code + "time.sleep(60)\n", guard=False, timeout_s=1.0, **layers)
        assert res.timed_out and not res.passed
        _assert_no_survivors(marker)


def _bomb(marker: str, hold_s: float) -> str:
    """Fork sleepers until refused, report how many, keep them alive ``hold_s`` seconds."""
    return (
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
        "print('forked', n, flush=True)\n"
        f"time.sleep({hold_s})\n"
    )


SYSTEM_PYTHON = "/usr/bin/python3"  # world-readable: process mode can drop to a leased uid with it


@pytest.mark.parametrize("mode", ["bwrap", "process"])
def test_unguarded_fork_bombs_are_contained_per_run(mode: str, first: Instance) -> None:
    """Three bombs alive at once beside an honest run: each gets the same budget (its own uid:
    RLIMIT_NPROC = max_processes, bubblewrap's own processes included), none eats another's, and
    the honest run passes. With one shared uid the counts differ: the later bombs starve (process
    mode) or get the others' processes added to their limit (the old `max_processes + tasks`)."""
    from concurrent.futures import ThreadPoolExecutor

    layers = {} if mode == "bwrap" else {**PROCESS, "python": SYSTEM_PYTHON}
    info = sandbox_info(layers.get("python"))
    marker = f"dlm-sandbox-test-{uuid.uuid4().hex}"
    task = HumanEvalTask(timeout_s=8.0)

    def bomb() -> tuple[float, object, float]:
        start = time.monotonic()
        res = run_python(_bomb(marker, 2.0), guard=False, max_processes=8, timeout_s=8.0, **layers)
        return start, res, time.monotonic()

    with ThreadPoolExecutor(4) as pool:
        bombs = [pool.submit(bomb) for _ in range(3)]
        honest = pool.submit(task.run, first, first.reference)
        results = [b.result() for b in bombs]
        assert honest.result().passed
    held_from = max(start + res.duration_s - 2.0 for start, res, _ in results)
    assert held_from < min(end for _, _, end in results), "the bombs never held their processes at the same time"
    counts = []
    for _, res, _ in results:
        assert res.passed, res.stderr_tail
        counts.append(int(res.stdout_tail.split()[-1]))
    if mode == "bwrap" or info.drops_privileges:
        assert len(set(counts)) == 1 and 1 <= counts[0] < 8, counts
    elif info.nproc_limited:  # not root: one budget for the user's processes
        assert all(c < 8 + 8 for c in counts), counts
    else:
        assert counts == [48] * 3
    _assert_no_survivors(marker)


def test_process_mode_kills_what_escaped_its_session() -> None:
    """A grandchild that calls setsid() leaves the process group; as root the run's own uid is
    swept when the run ends, so it dies all the same."""
    marker = f"dlm-sandbox-test-{uuid.uuid4().hex}"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['{marker}', '60'])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
    )
    res = run_python(code, guard=False, python=SYSTEM_PYTHON, **PROCESS)
    assert res.passed, res.stderr_tail
    if sandbox_info(SYSTEM_PYTHON).drops_privileges:
        _assert_no_survivors(marker)
    else:  # not root: nothing can sweep a uid; clean up what the documented gap left
        for pid in _live_processes_with(marker):
            os.kill(pid, 9)


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
        # Without the prelude: bubblewrap's network namespace blocks it; the process layer does
        # where the kernel lets it create one.
        connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        assert not run_python(connect, guard=False).passed
        res = run_python(connect, guard=False, **PROCESS)
        assert res.passed == (not sandbox_info().network_namespace)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


# ----------------------------------------------------------------------------- hygiene
def test_environment_stdin_tmpdir_and_output_cap() -> None:
    for layers in (PROCESS, {}):
        res = run_python("import os\nprint(os.getcwd())\nprint(sorted(os.environ))\n", **layers)
        assert res.passed
        cwd_line, env_line = res.stdout_tail.strip().splitlines()
        assert not Path(cwd_line).exists() or cwd_line == "/sandbox"  # deleted afterwards / private
        assert set(eval(env_line)) <= {"PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "LC_CTYPE", "PWD"}
    start = time.perf_counter()
    assert not run_python("input()\n", timeout_s=5.0).passed  # EOF at once, no hang
    assert time.perf_counter() - start < 2.0
    flood = run_python("import sys\nfor _ in range(100000):\n    sys.stdout.write('x' * 100)\n",
                       output_limit_bytes=1 << 16)
    assert not flood.passed and len(flood.stdout_tail) <= 4000


def test_privileges_match_reported_isolation() -> None:
    info = sandbox_info()
    if os.geteuid() == 0:  # process mode: a leased uid, never root, never the evaluator's
        res = run_python("import os\nprint(os.getuid(), os.geteuid())\n", **PROCESS)
        assert res.passed, res.stderr_tail
        uid, euid = map(int, res.stdout_tail.split())
        assert uid == euid and POOL_FIRST <= uid < POOL_FIRST + POOL_SIZE
    else:  # one uid for both sides: process mode refuses
        with pytest.raises(SandboxUnavailable, match="root"):
            run_python("x = 1\n", **PROCESS)
    boxed = run_python("import os\nprint(os.getuid())\n")
    assert boxed.passed
    if os.geteuid() == 0:
        assert info.per_run_uid and POOL_FIRST <= int(boxed.stdout_tail) < POOL_FIRST + POOL_SIZE
    else:
        assert int(boxed.stdout_tail) == os.geteuid()
    assert sandbox_info(sys.executable) is sandbox_info(sys.executable)  # cached probe


# ----------------------------------------------------------------------------- the OS sandbox
def _hostile_rows(marker: str, outside: Path, secret: str) -> dict[str, str]:
    """HumanEval completions (function bodies) that try to escape, harm the host or forge a pass."""
    return {
        "setsid + execv outlives the run": (
            "    import posix\n    posix.setsid()\n"
            f"    posix.execv('/bin/sleep', ['{marker}', '300'])\n"),
        "kill the parent": "    import posix\n    posix.kill(posix.getppid(), 9)\n    return True\n",
        "kill every process it can": "    import posix\n    posix.kill(-1, 9)\n    return True\n",
        "wrong body + posix._exit(0)": "    import posix\n    posix._exit(0)\n",
        "wrong body + kill itself": "    import posix\n    posix.kill(posix.getpid(), 9)\n",
        "forge the result pipe": (
            "    import posix\n    for fd in range(3, 64):\n        try:\n"
            "            posix.write(fd, b'0' * 32)\n        except OSError:\n            pass\n"
            "    posix._exit(0)\n"),
        "ctypes libc _exit(0)": (
            "    import sys\n    for m in ('ctypes', '_ctypes'):\n        sys.modules.pop(m, None)\n"
            "    import ctypes\n    ctypes.CDLL(None)._exit(0)\n"),
        "write outside": (
            f"    for p in ({str(outside)!r}, '/usr/lib/dlm-leak', '/root/dlm-leak', '/etc/dlm-leak'):\n"
            "        try:\n            open(p, 'w').write('x')\n        except OSError:\n            pass\n"
            "    return True\n"),
        "read the parent's environment": (
            "    import posix\n    for pid in posix.listdir('/proc'):\n        try:\n"
            "            print(open(f'/proc/{pid}/environ', 'rb').read())\n        except (OSError, ValueError):\n"
            f"            pass\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"),
        "50 forks": (
            "    import posix\n    for _ in range(50):\n        try:\n            if posix.fork() == 0:\n"
            f"                posix.execv('/bin/sleep', ['{marker}', '300'])\n        except OSError:\n"
            "            pass\n    return True\n"),
        "socket through _socket": (
            "    import sys\n    sys.modules.pop('_socket', None)\n    import _socket\n"
            "    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
            "    s.connect(('1.1.1.1', 53))\n    return True\n"),
    }


HOSTILE = sorted(_hostile_rows("m", Path("/x"), "s"))


@pytest.fixture(scope="module")
def bystander():
    """A host process the code must not be able to kill."""
    import subprocess

    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_completions_score_zero_and_leave_nothing(name: str, first: Instance, tmp_path: Path, bystander,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row runs through the real bubblewrap sandbox (the default): it scores 0, no process of
    it survives, nothing is written outside, the evaluator and the host's processes keep running."""
    assert sandbox_info().bwrap is not None, sandbox_info().bwrap_problem  # scripts/test.sh installs bubblewrap
    marker = f"dlm-sandbox-test-{uuid.uuid4().hex}"
    secret = uuid.uuid4().hex
    monkeypatch.setenv("DLM_SANDBOX_SECRET", secret)
    outside = tmp_path / "leak"
    task = HumanEvalTask(timeout_s=3.0)
    res = task.run(first, _hostile_rows(marker, outside, secret)[name])
    assert not res.passed
    assert secret not in res.stdout_tail + res.stderr_tail + res.candidate_stdout_tail + res.candidate_stderr_tail
    _assert_no_survivors(marker)
    assert bystander.poll() is None, "killed a host process"
    assert not outside.exists()
    for path in ("/usr/lib/dlm-leak", "/root/dlm-leak", "/etc/dlm-leak"):
        assert not Path(path).exists()


def test_the_evaluator_still_works_after_the_hostile_rows(task: HumanEvalTask, first: Instance) -> None:
    assert task.score(first, first.reference) == 1.0


def test_a_forged_exit_never_passes_without_the_token() -> None:
    for layers in (PROCESS, {}):
        assert run_python("x = 1\n", **layers).passed
        for early in ("import posix\nposix._exit(0)\n", "import sys\nsys.exit(0)\n",
                      "import posix\nposix.kill(posix.getpid(), 9)\n"):
            res = run_python(early, **layers)
            assert not res.passed, (layers, early)


def test_without_bubblewrap_untrusted_code_is_refused_unless_unsafe_exec(tmp_path, monkeypatch, capsys) -> None:
    from dlm_toolkit.cli import main as cli_main
    from dlm_toolkit.tasks.sandbox import SandboxUnavailable, check_isolation

    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without bwrap
    sandbox_info.cache_clear()
    try:
        info = sandbox_info()
        assert info.bwrap is None and "bwrap" in info.bwrap_problem
        with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*--unsafe-exec"):
            HumanEvalTask()
        with pytest.raises(SandboxUnavailable):
            run_python("x = 1\n")
        with pytest.raises(SandboxUnavailable, match="unsafe_exec"):
            run_python("x = 1\n", isolation="process")
        assert check_isolation(unsafe_exec=True) == "process"
        task = HumanEvalTask(unsafe_exec=True)
        problem = task.instances(1, 0, "eval")[0]
        assert task.isolation == "process" and task.score(problem, problem.reference) == 1.0
        ckpt = str(Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-editable")
        cmd = ["eval", "--checkpoint", ckpt, "--task", "humaneval", "--n", "1"]
        assert cli_main(cmd) == 2
        assert "bubblewrap" in capsys.readouterr().err
    finally:
        monkeypatch.undo()
        sandbox_info.cache_clear()
