"""Hostile candidates against the evaluator itself (issue 35, items 1, 2 and 8).

Each row is a *wrong* solution of ``add`` that also attacks: the channels the harness reads back
(capture files replaced by symlinks, FIFOs, devices; deep, unreadable trees left behind), the test
side's report pipe through ``/proc/<pid>/fd`` (process mode: both sides share a PID namespace and
see each other), the sandbox's ``/tmp`` and working folder, memory through forked children. Every
row, under bubblewrap and in process mode, asserts: score 0 with a reason; no byte of a root-only
secret in anything the evaluator returns; no ``dlm-sandbox-*`` folder and no process left; done in
seconds (a hang fails the row, it does not stop the suite); and a correct solution run beside it
at the same time still scores 1.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dlm_toolkit.tasks.sandbox import SandboxUnavailable, run_python, run_tests, sandbox_info
from dlm_toolkit.tasks.sandbox.cgroup import cgroup_base
from dlm_toolkit.tasks.sandbox.limits import POOL_FIRST, POOL_SIZE, leased, tasks_of
from dlm_toolkit.tasks.sandbox.process import remove_tree
from dlm_toolkit.tasks.sandbox.runner import REPORT_LIMIT

TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
GOOD = "def add(a, b):\n    return a + b\n"
WRONG = "\ndef add(a, b):\n    return a - b\n"
ROOT = os.geteuid() == 0
MODES = {"bwrap": {}, "process": {"isolation": "process", "unsafe_exec": True}}
HANG_S = 60  # far above any row's real time: only a hang gets near it


@pytest.fixture(scope="module")
def secret():
    """A root-only file (0600 in a 0700 folder) holding a random token the code must never get out."""
    folder = Path(tempfile.mkdtemp(prefix="secret-"))
    token = uuid.uuid4().hex
    path = folder / "shadow"
    path.write_text(f"root:{token}:19000:0:99999:7:::\n")
    path.chmod(0o600)
    folder.chmod(0o700)
    yield path, token
    remove_tree(folder)


def _symlink_captures(target: str) -> str:
    """Point every name the evaluator could reopen (old and new) at ``target``, then print a lot."""
    return (
        "import posix\n"
        "for name in ('.stdout', '.stderr', 'stdout', 'stderr', '.report', 'report'):\n"
        "    try:\n        posix.rename(name, name + '.old')\n    except OSError:\n        pass\n"
        f"    try:\n        posix.symlink({target!r}, name)\n    except OSError:\n        pass\n"
        "print('x' * 100)\n"
    )


def _fifo_captures() -> str:
    return (
        "import posix\n"
        "for name in ('.stdout', '.stderr', 'stdout', 'stderr'):\n"
        "    try:\n        posix.unlink(name)\n    except OSError:\n        pass\n"
        "    posix.mkfifo(name)\n"
    )


def _deep_tree(depth: int) -> str:  # nested folders, a FIFO, a symlink out, unreadable folders and files
    return (
    "import posix\n"
    "posix.mkfifo('fifo')\n"
    "posix.symlink('/', 'root')\n"
    "posix.mkdir('locked')\n"
    "open('locked/f', 'w').close()\n"
    "posix.chmod('locked/f', 0)\n"
    "posix.chmod('locked', 0)\n"
    "here = posix.getcwd()\n"
    f"for i in range({depth}):\n"
    "    posix.mkdir('d')\n"
    "    posix.chdir('d')\n"
    "open('bottom', 'w').write('x')\n"
    "posix.chmod('.', 0o500)\n"
    "posix.chdir(here)\n"
    )

# Finds the other sandboxed interpreters through /proc, opens each of their descriptors and writes
# a passing report, padded to what the harness reads (what a shared uid allowed before).
FORGE = (
    "import posix, json, fcntl\n"
    "me = str(posix.getpid())\n"
    "report = json.dumps({'passed': True, 'reason': '', 'calls': 2}).encode()\n"
    f"report += b' ' * ({REPORT_LIMIT} - len(report))\n"
    "mine, pid = set(), me\n"
    "while pid not in ('0', '1') or not mine:\n"
    "    mine.add(pid)\n"
    "    try:\n        pid = [l.split()[1] for l in open(f'/proc/{pid}/status') if l.startswith('PPid:')][0]\n"
    "    except (OSError, IndexError):\n        break\n"
    "mine.add(pid)\n"
    "seen = opened = 0\n"
    "for pid in posix.listdir('/proc'):\n"
    "    if not pid.isdigit() or pid in mine:\n        continue\n"
    "    try:\n        cmdline = open(f'/proc/{pid}/cmdline', 'rb').read()\n    except OSError:\n        continue\n"
    "    if b'dlm-sandbox-runner' not in cmdline:\n        continue\n"
    "    seen += 1\n"
    "    try:\n        fds = posix.listdir(f'/proc/{pid}/fd')\n    except OSError:\n        fds = [str(i) for i in range(64)]\n"
    "    for fd in fds:\n"
    "        try:\n            w = posix.open(f'/proc/{pid}/fd/{fd}', posix.O_WRONLY | posix.O_NONBLOCK)\n"
    "        except OSError:\n            continue\n"
    "        opened += 1\n"
    "        try:\n            fcntl.fcntl(w, 1031, 1 << 20)\n        except OSError:\n            pass\n"
    "        try:\n            posix.write(w, report)\n        except OSError:\n            pass\n"
    "print('seen', seen, 'opened', opened, flush=True)\n"
)

BIG_TMP = (  # 1 MiB files (the per-file limit) into /tmp and the working folder until refused
    "import posix\n"
    "def fill(folder):\n"
    "    written = 0\n"
    "    for i in range(400):\n"
    "        try:\n"
    "            with open(f'{folder}/big{i}', 'wb') as f:\n"
    "                f.write(b'x' * (1 << 20))\n"
    "        except OSError:\n"
    "            break\n"
    "        written += 1 << 20\n"
    "    return written\n"
    "print('tmp', fill('/tmp'), 'work', fill('.'), flush=True)\n"
)

MEMORY_BOMB = (  # children that each take and touch 100 MiB, as many as it may fork; how many are alive then
    "import posix, time\n"
    "pids = []\n"
    "for _ in range(16):\n"
    "    r, w = posix.pipe()\n"
    "    try:\n        pid = posix.fork()\n    except OSError:\n        break\n"
    "    if pid == 0:\n"
    "        try:\n            x = bytearray(100 << 20)\n            x[::4096] = b'1' * len(x[::4096])\n"
    "            posix.write(w, b'1')\n"
    "        except MemoryError:\n            posix.write(w, b'0')\n"
    "        time.sleep(30)\n        posix._exit(0)\n"
    "    posix.close(w)\n"
    "    if posix.read(r, 1) == b'1':\n        pids.append(pid)\n"
    "time.sleep(0.5)\n"  # a child the OOM killer chose may take a moment to die
    "alive = sum(posix.waitpid(pid, posix.WNOHANG) == (0, 0) for pid in pids)\n"
    "print('held', len(pids), 'alive', alive, flush=True)\n"
)


UID = "import posix\nprint('uid', posix.getuid(), flush=True)\n"


def _rows(secret_path: str) -> dict[str, str]:
    return {
        "capture files symlinked to a root-only file": _symlink_captures(secret_path),
        "capture files symlinked to /dev/zero": _symlink_captures("/dev/zero"),
        "capture files replaced by FIFOs": _fifo_captures(),
        "5000-deep tree, FIFO, symlink, unreadable folders": _deep_tree(5000),
        "report forged through /proc/<pid>/fd": FORGE,
        "huge /tmp and working-folder writes": BIG_TMP,
        "fork bomb of memory": MEMORY_BOMB,
    }


ROWS = sorted(_rows("/x"))


@pytest.fixture
def private_tmp(monkeypatch):
    """Where this test's sandbox folders go (other runs on the machine use the shared one): 0711,
    so a pool uid can enter its own folder in it."""
    folder = Path(tempfile.mkdtemp(prefix="hostile-"))
    folder.chmod(0o711)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    monkeypatch.undo()
    remove_tree(folder)


def _fields(text: str) -> dict[str, int]:
    """``key value`` pairs a row printed."""
    return {k: int(v) for k, v in re.findall(r"([a-z]+) (-?\d+)", text)}


def _run(mode: str, solution: str, **kw):
    return run_tests(solution, TESTS, "add", timeout_s=5.0, memory_mb=256, guard=True, **MODES[mode], **kw)


def _with_deadline(fn, *args, **kw):
    """``fn(*args, **kw)`` in a daemon thread: a hang fails the row instead of stopping the suite."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kw)
        except BaseException as err:  # noqa: BLE001 -- re-raised in the test's thread
            box["error"] = err
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(HANG_S)
    assert not worker.is_alive(), f"the evaluator hung for {HANG_S} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _usable(mode: str) -> bool:
    if mode == "bwrap":
        assert sandbox_info().bwrap is not None, sandbox_info().bwrap_problem  # test deps install bubblewrap
        return True
    if not ROOT:  # one uid for both sides: process mode must refuse, in one line
        with pytest.raises(SandboxUnavailable, match="only an evaluator running as root") as err:
            _run(mode, GOOD)
        assert "\n" not in str(err.value)
        return False
    return True


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("row", ROWS)
def test_a_hostile_candidate_scores_zero_leaks_nothing_and_leaves_nothing(row: str, mode: str, secret,
                                                                          private_tmp: Path) -> None:
    if not _usable(mode):
        return
    path, token = secret
    with ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(_with_deadline, _run, mode, UID + _rows(str(path))[row] + WRONG)
        honest = pool.submit(_with_deadline, _run, mode, GOOD)
        bad, good = hostile.result(), honest.result()
    assert good.passed, good
    assert not bad.passed and bad.reason, bad
    assert token not in repr(bad) and token not in repr(good)
    assert not list(private_tmp.iterdir())  # no dlm-sandbox-* folder left
    out = _fields(bad.candidate_stdout_tail)
    if ROOT:
        assert not tasks_of(out["uid"], live_only=True), "a process of the run outlived it"
    if row == "report forged through /proc/<pid>/fd":
        assert out["opened"] == 0, out
        assert out["seen"] >= (1 if mode == "process" else 0), out  # process mode: the test side is in plain sight
    elif row == "huge /tmp and working-folder writes" and (mode == "bwrap" or sandbox_info().mount_namespace):
        assert 0 < out["tmp"] <= 64 << 20 and 0 < out["work"] <= 64 << 20, out
    elif row == "fork bomb of memory":
        if ROOT and cgroup_base() is not None:  # one memory cgroup per side: 256 + 64 + 64 + 2 MiB together
            assert out["alive"] * 100 <= 256 + 64 + 64 + 2, out
        else:  # the documented fallback: RLIMIT_NPROC x RLIMIT_AS, 16 processes of 256 MiB at most
            assert out["held"] < 16, out
    elif row.startswith("capture files symlinked"):  # its own output still comes back
        assert "x" * 100 in bad.candidate_stdout_tail


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_test_side_and_the_candidate_never_share_a_uid_and_neither_is_root(mode: str) -> None:
    if not _usable(mode):
        return
    show = "import posix\nprint('uid', posix.getuid(), posix.geteuid())\n"
    tests = show + TESTS
    res = run_tests(show + GOOD, tests, "add", timeout_s=5.0, **MODES[mode])
    assert res.passed, res
    cand = [int(x) for x in res.candidate_stdout_tail.split()[1:]]
    test = [int(x) for x in res.stdout_tail.split()[1:]]
    if mode == "process" or ROOT:
        assert len(set(cand)) == 1 and len(set(test)) == 1 and cand[0] != test[0]
        assert POOL_FIRST <= cand[0] < POOL_FIRST + POOL_SIZE and POOL_FIRST <= test[0] < POOL_FIRST + POOL_SIZE


def test_no_fd_number_or_config_on_a_readable_command_line_or_environment() -> None:
    """What the candidate can read of any sandboxed process: the fixed bootstrap, never the config."""
    probe = (
        "import posix\n"
        "seen = []\n"
        "for pid in posix.listdir('/proc'):\n"  # the sandboxed interpreters (other code on the machine aside)
        "    try:\n        cmdline = open(f'/proc/{pid}/cmdline', 'rb').read()\n    except OSError:\n        continue\n"
        "    if b'dlm-sandbox-runner' not in cmdline:\n        continue\n"
        "    seen.append(cmdline)\n"
        "    try:\n        seen.append(open(f'/proc/{pid}/environ', 'rb').read())\n    except OSError:\n        pass\n"
        "blob = b'|'.join(seen)\n"
        "print('runner' if b'dlm-sandbox-runner' in blob else 'none', 'fd' if b'_fd' in blob else 'clean',\n"
        "      'cfg' if b'entry_point' in blob else 'clean')\n"
    )
    for mode in sorted(MODES):
        if not _usable(mode):
            continue
        res = run_tests(probe + GOOD, TESTS, "add", timeout_s=5.0, **MODES[mode])
        assert res.passed, res
        found, fds, cfg = res.candidate_stdout_tail.split()
        assert found == "runner" and fds == "clean" and cfg == "clean", (mode, res.candidate_stdout_tail)
        assert "entry_point" not in repr(os.environ)


@pytest.mark.parametrize("shape", ["deep", "locked", "special"])
def test_remove_tree_removes_what_sandboxed_code_leaves(shape: str, tmp_path: Path) -> None:
    """The process-mode folder remover against a hand-built tree (a plain reference: afterwards
    nothing of the tree exists and everything the symlink pointed at is untouched)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    top = tmp_path / "dlm-sandbox-x"
    top.mkdir()
    if shape == "deep":
        if Path("/dev/shm").is_dir():  # tmpfs, as process mode's folders are: rmdir is ~4 ms on this disk
            top = Path(tempfile.mkdtemp(prefix="dlm-sandbox-test-", dir="/dev/shm"))
        fd = os.open(top, os.O_RDONLY)
        for _ in range(5000):  # deeper than the recursion limit and the fd limit
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.close(fd)
    elif shape == "locked":
        (top / "a" / "b").mkdir(parents=True)
        (top / "a" / "b" / "f").write_text("x")
        (top / "a" / "b").chmod(0)
        (top / "a").chmod(0o500)
    else:
        os.mkfifo(top / "fifo")
        (top / "link").symlink_to(outside)
        (top / "file-link").symlink_to(outside / "keep")
        (top / "dev").symlink_to("/dev/zero")
    remove_tree(top)
    assert not top.exists() and not top.is_symlink()
    assert (outside / "keep").read_text() == "keep"
    remove_tree(top)  # already gone: nothing to do, no error
    link = tmp_path / "link-to-outside"
    link.symlink_to(outside)
    remove_tree(link)  # a symlink in its place: the link goes, never what it points at
    assert not link.is_symlink() and (outside / "keep").exists() and stat.S_ISDIR(os.lstat(outside).st_mode)


@pytest.fixture
def without_mount_namespace(monkeypatch):
    """Process mode on a machine whose kernel refuses it a mount namespace: a host folder it removes."""
    from dlm_toolkit.tasks.sandbox import runner

    real = runner.process_interpreter
    monkeypatch.setattr(runner, "process_interpreter",
                        lambda python=None: dataclasses.replace(real(python), mount_namespace=False))


@pytest.mark.parametrize("row", ["5000-deep tree, FIFO, symlink, unreadable folders",
                                 "capture files symlinked to a root-only file", "capture files replaced by FIFOs"])
def test_process_mode_on_the_host_disk_removes_what_the_code_leaves(row: str, secret, private_tmp: Path,
                                                                   without_mount_namespace) -> None:
    if not _usable("process"):
        return
    path, token = secret
    code = _rows(str(path))[row] if "deep" not in row else _deep_tree(1100)  # past the recursion limit;
    # rmdir costs ~4 ms on this machine's disk: 5,000 levels (the tmpfs rows) would take 20 s here
    res = _with_deadline(_run, "process", "import os\nprint('at', os.getcwd(), flush=True)\n" + code + WRONG)
    assert not res.passed and res.reason and token not in repr(res)
    assert f"at {private_tmp}/dlm-sandbox-" in res.candidate_stdout_tail  # it did run on the host folder
    assert not list(private_tmp.iterdir())
    assert _run("process", GOOD).passed


EVALUATOR = """
import os, sys, tempfile, threading
tempfile.tempdir = sys.argv[1]
ready = int(sys.argv[3])
marker = os.environ["MARKER"].encode()

def announce():  # tell the test (through its pipe) the moment the candidate runs as /bin/sleep
    while True:
        for name in os.listdir("/proc"):
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if name.isdigit() and marker in f.read():
                        os.write(ready, name.encode() + b"\\n")
                        return
            except OSError:
                pass
        threading.Event().wait(0.01)

from dlm_toolkit.tasks.sandbox import run_tests
kw = {"isolation": "process", "unsafe_exec": True} if sys.argv[2] == "process" else {}
threading.Thread(target=announce, daemon=True).start()
run_tests(f"import posix\\nposix.execv('/bin/sleep', [{os.environ['MARKER']!r}, '60'])\\n",
          "assert add(1, 2) == 3\\n", "add", timeout_s=60.0, **kw)
"""


def _wait_readable(fd: int, what: str) -> None:
    """Block until ``fd`` is readable (the event); ``HANG_S`` only bounds a hang, it paces nothing."""
    readable, _, _ = select.select([fd], [], [], HANG_S)
    assert readable, f"no {what} in {HANG_S} s: a hang"


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_evaluator_killed_mid_run_leaves_no_process_and_no_folder(mode: str, private_tmp: Path) -> None:
    """SIGKILL: no handler of ours runs (SIGTERM's default action is the same). ~6 s: the evaluator imports.

    No clock: the evaluator writes to a pipe once its candidate runs (as ``/bin/sleep``), and the
    candidate's exit is awaited on its pidfd; a loaded machine only makes both events later."""
    if not _usable(mode):
        return
    marker = f"dlm-sandbox-test-{uuid.uuid4().hex}"
    ready_r, ready_w = os.pipe()
    evaluator = subprocess.Popen([sys.executable, "-c", EVALUATOR, str(private_tmp), mode, str(ready_w)],
                                 env={**os.environ, "MARKER": marker},  # not on its command line: we look for it
                                 pass_fds=(ready_w,), stderr=subprocess.PIPE)
    os.close(ready_w)  # the evaluator holds the only write end: its death reads as end of file
    try:
        _wait_readable(ready_r, "word from the evaluator")
        started = os.read(ready_r, 64)
        assert started, "the candidate never started (the evaluator exited): " + evaluator.stderr.read().decode()[-2000:]
        candidates = [os.pidfd_open(pid) for pid in _with_marker(marker)]  # the sleeper (and its wrappers)
        assert candidates, "the candidate the evaluator saw is gone before the kill"
        evaluator.kill()
        evaluator.wait()
        for pidfd in candidates:  # a pidfd turns readable when its process has exited
            _wait_readable(pidfd, "exit of the candidate after its evaluator died")
            os.close(pidfd)
        assert not _with_marker(marker), "the candidate outlived its evaluator"
        assert not list(private_tmp.iterdir())
        base = cgroup_base()
        if base is not None:  # its two memory groups stay until the next evaluator starts, which sweeps them
            left = set(base.path.glob("dlm-sandbox-*"))
            cgroup_base.cache_clear()
            try:
                assert cgroup_base() == base
                assert not [g for g in left if g.exists() and not leased(int(g.name.rpartition("-")[2]))]
            finally:
                cgroup_base.cache_clear()
    finally:
        os.close(ready_r)
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.wait()
        evaluator.stderr.close()
        for pid in _with_marker(marker):
            os.kill(pid, signal.SIGKILL)


def _with_marker(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_process_mode_refuses_an_interpreter_the_pool_uids_cannot_read(tmp_path: Path) -> None:
    """A pyenv under /root: its uids could not run it, so process mode says so rather than run as root."""
    if not _usable("process"):
        return
    base = Path(tempfile.mkdtemp(prefix="interpreter-"))
    base.chmod(0o755)
    closed = base / "closed"
    (closed / "bin").mkdir(parents=True)
    python = closed / "bin" / "python3"
    shutil.copy2(os.path.realpath("/usr/bin/python3"), python)
    closed.chmod(0o700)  # root can run it; a pool uid cannot even reach it
    with pytest.raises(SandboxUnavailable, match="cannot read the interpreter") as err:
        run_tests(GOOD, TESTS, "add", python=str(python), **MODES["process"])
    assert str(python) in str(err.value) and "\n" not in str(err.value)
    closed.chmod(0o755)  # the near miss: readable by others, it runs under a leased uid
    sandbox_info.cache_clear()
    try:
        res = run_tests(GOOD, TESTS, "add", python=str(python), **MODES["process"])
        assert res.passed, res
    finally:
        sandbox_info.cache_clear()
        remove_tree(base)


FILL = (  # 256 KiB files into FOLDER until refused; prints how many bytes went in
    "written = 0\n"
    "for i in range(64):\n"
    "    try:\n"
    "        with open(FOLDER + '/f' + str(i), 'wb') as f:\n"
    "            f.write(b'x' * (256 << 10))\n"
    "    except OSError:\n"
    "        break\n"
    "    written += 256 << 10\n"
    "print('written', written)\n"
)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("folder", ["/tmp", "."])
def test_tmp_and_working_folder_sizes_are_the_ones_asked_for(mode: str, folder: str) -> None:
    """2 MiB holds at most 8 files of 256 KiB (fewer: tmpfs keeps some for itself); 3 MiB, the near
    miss, holds more than 2 MiB."""
    if not _usable(mode) or (mode == "process" and not sandbox_info("/usr/bin/python3").mount_namespace):
        return
    key = "tmp_mb" if folder == "/tmp" else "workdir_mb"
    code = f"FOLDER = {folder!r}\n" + FILL
    small = run_python(code, **{key: 2}, **MODES[mode])
    larger = run_python(code, **{key: 3}, **MODES[mode])
    assert small.passed and larger.passed, (small, larger)
    small_n, larger_n = _fields(small.stdout_tail)["written"], _fields(larger.stdout_tail)["written"]
    assert (1 << 20) < small_n <= 2 << 20 < larger_n <= 3 << 20, (small_n, larger_n)
    with pytest.raises(ValueError, match="tmp_mb must be a positive integer"):
        run_python("x = 1\n", tmp_mb=0)


CHILDREN = (  # six children of 64 MiB each, touched; how many are alive once all were started
    "import os, time\n"
    "pids = []\n"
    "for _ in range(6):\n"
    "    r, w = os.pipe()\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        x = bytearray(64 << 20)\n"
    "        x[::4096] = b'1' * len(x[::4096])\n"
    "        os.write(w, b'1')\n"
    "        time.sleep(30)\n"
    "        os._exit(0)\n"
    "    os.close(w)\n"
    "    os.read(r, 1)\n"
    "    pids.append(pid)\n"
    "time.sleep(0.5)\n"  # a child the OOM killer chose may take a moment to die
    "print('alive', sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids), flush=True)\n"
)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_memory_of_all_processes_of_a_run_together_is_bounded(mode: str) -> None:
    """With a memory cgroup (root, a writable controller): memory_mb + tmp_mb + workdir_mb + twice
    the output limit for all processes together, so of six 64 MiB children at most two live under
    128 + 1 + 1 + 2 MiB, and all six under 512 MiB (the near miss). Without one: the documented
    per-process bound only (all six live)."""
    if not _usable(mode):
        return
    kw = dict(guard=False, tmp_mb=1, workdir_mb=1, max_processes=16, timeout_s=20.0, **MODES[mode])
    tight = run_python(CHILDREN, memory_mb=128, **kw)
    roomy = run_python(CHILDREN, memory_mb=512, **kw)
    assert roomy.passed and _fields(roomy.stdout_tail)["alive"] == 6, roomy
    if ROOT and cgroup_base() is not None:
        assert tight.passed and _fields(tight.stdout_tail)["alive"] * 64 <= 128 + 1 + 1 + 2, tight  # 2 at most
    else:
        assert tight.passed and _fields(tight.stdout_tail)["alive"] == 6, tight


@pytest.mark.parametrize("mode", sorted(MODES))
def test_large_test_files_do_not_count_against_the_working_folder(mode: str) -> None:
    """A 3 MiB test file (LiveCodeBench-sized inputs) under workdir_mb=1: the folder holds the code
    files on top of the code's 1 MiB; the code itself still gets no more than that."""
    if not _usable(mode):
        return
    big = "DATA = " + repr("x" * (3 << 20)) + "\n" + TESTS
    res = run_tests(GOOD, big, "add", workdir_mb=1, **MODES[mode])
    assert res.passed, res
    if mode == "bwrap" or sandbox_info("/usr/bin/python3").mount_namespace:
        fill = run_tests("FOLDER = '.'\n" + FILL + GOOD, big, "add", workdir_mb=1, **MODES[mode])
        assert fill.passed and 0 < _fields(fill.candidate_stdout_tail)["written"] <= 1 << 20, fill


def test_process_mode_without_root_refuses_in_one_line(monkeypatch) -> None:
    """One uid for both sides (a non-root evaluator) is refused where the process is started, even
    with a probe that said otherwise; bubblewrap, the near miss, still runs (its own user namespace)."""
    if not ROOT:
        _usable("process")  # the real thing: refused
        return
    sandbox_info("/usr/bin/python3")  # probed as root (cached): the start itself must refuse
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    try:
        with pytest.raises(SandboxUnavailable, match="only an evaluator running as root") as err:
            run_tests(GOOD, TESTS, "add", **MODES["process"])
        assert "\n" not in str(err.value) and "apt-get install bubblewrap" in str(err.value)
    finally:
        monkeypatch.undo()
        sandbox_info.cache_clear()  # nothing probed under the fake uid may stay
    assert _run("process", GOOD).passed
