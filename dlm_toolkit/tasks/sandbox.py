"""Run untrusted Python (model-written code) in a throw-away, isolated, resource-limited process.

:func:`run_python` executes ``code`` in a fresh ``python -I`` process and reports whether it
finished without an exception.

**The OS sandbox (default): bubblewrap.** The code runs under ``bwrap`` (Debian package
``bubblewrap``) with new user, PID, network, mount, IPC, UTS and cgroup namespaces, every
capability dropped, ``--die-with-parent`` and ``--new-session``. Its file system is an empty
tmpfs holding ``/usr`` (read-only), the interpreter's prefix (read-only), a private ``/tmp`` and
the run's own working folder: nothing of the host is writable and nothing else is visible. In
its PID namespace it sees only itself (no parent to kill, no ``/proc/<parent>/environ`` to read),
and when the run ends the namespace's init exits, which kills everything left in it. As root,
``bwrap`` itself starts as ``nobody``, so the code runs with an unprivileged uid on the host too
and ``RLIMIT_NPROC`` stops fork bombs (the kernel never enforces it for uid 0). Where ``bwrap``
is missing or cannot create namespaces, :func:`run_python` refuses (:class:`SandboxUnavailable`)
unless the caller passes ``unsafe_exec=True`` (``--unsafe-exec``; never silently weaker): then
only the process-level layers below apply.

**The verdict cannot come from an exit code.** The harness hands the child a per-run random
token through a pipe and the child writes it to a second pipe only after ``exec(code)`` returned
normally; a run passes iff that token comes back *and* the process exits 0 in time. Exiting
early (``sys.exit(0)``, ``posix._exit(0)``, killing itself) therefore never passes. (Code that
deliberately reads the harness's own pipe out of its process could still forge the token; the
namespaces above keep it from harming anything while it does.)

Layers inside the sandbox (and, with ``unsafe_exec``, the only ones), outermost first:

1. **Process lifetime.** The child starts in a new session (its own process group). When the
   code finishes *or* the wall-clock timeout hits, the whole group gets ``SIGKILL`` while the
   leader is still un-reaped (so the group id cannot be reused), killing any children it forked.
   A grandchild that calls ``setsid()`` itself could escape the group; the prelude below
   disables ``os.setsid``/``os.fork`` and friends so that needs a deliberate double bypass.
2. **Resource limits**, set by a trusted prelude inside the child before any untrusted byte
   runs (not via ``preexec_fn``, which is unsafe when several threads spawn sandboxes):
   ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU`` (timeout + 1 s), ``RLIMIT_FSIZE`` (caps
   stdout/stderr and any file written), ``RLIMIT_CORE = 0``.
3. **Privileges.** When the evaluator runs as root, the child drops to ``nobody`` (no
   supplementary groups) after reading its code -- *if* the interpreter and its ``sys.path`` are
   world-readable, which is checked once per interpreter (a pyenv under ``/root`` is not; then
   the child stays root and only the other layers apply). Once non-root, ``RLIMIT_NPROC``
   stops fork bombs (the kernel never enforces it for uid 0). When the evaluator is not root,
   ``RLIMIT_NPROC`` is set to the user's current task count plus ``max_processes``.
4. **Network.** As root, the child first moves into a fresh network namespace
   (``unshare(CLONE_NEWNET)``: no interfaces up, not even loopback) when the kernel allows it;
   never required.
5. **Reliability prelude** (defence in depth, not a security boundary -- it is bypassable by
   determined code): replaces ``os.fork``/``os.system``/``os.exec*``/``os.spawn*``/``os.kill``/
   ``os.setsid``, destructive file operations, ``subprocess.*``, ``socket.*`` and
   ``shutil.rmtree`` etc. with functions raising ``PermissionError`` and makes ``ctypes``,
   ``_posixsubprocess``, ``multiprocessing`` and ``_socket`` un-importable.

The child's stdin is ``/dev/null``, its environment is minimal (``PATH``, ``LANG``,
``LC_ALL``, ``HOME``, ``TMPDIR``), its working directory is a new temporary directory that is
deleted afterwards, and its stdout/stderr go to capped files whose tails are returned.
Linux only (uses ``/proc``, process groups and, when present, pidfds).

A run *passes* iff the code ran to its end without raising (``SystemExit`` included, so
``sys.exit(0)`` before the tests counts as a failure) and without timing out; with the prelude
installed (``os._exit`` disabled), only the trusted runner can exit with status 0.

:func:`sandbox_info` reports which layers are active on this machine.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dlm_toolkit.config import ConfigError

__all__ = ["SandboxInfo", "SandboxResult", "SandboxUnavailable", "run_python", "sandbox_info"]

_TAIL_CHARS = 4000
_SANDBOX_USER = "nobody"
_SYSTEM_PYTHON = "/usr/bin/python3"


class SandboxUnavailable(ConfigError):
    """The OS sandbox cannot run here and the caller did not accept running without it."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of :func:`run_python`.

    Attributes:
        passed: the code ran to completion without an exception and without timing out.
        returncode: the child's exit status (negative: killed by that signal).
        timed_out: the wall-clock limit was hit and the process group was killed.
        stderr_tail: the last ~4000 characters of stderr (tracebacks end up here).
        stdout_tail: the last ~4000 characters of stdout.
        duration_s: wall-clock seconds from start to reaping.
    """

    passed: bool
    returncode: int | None
    timed_out: bool
    stderr_tail: str
    stdout_tail: str = ""
    duration_s: float = 0.0


@dataclass(frozen=True)
class SandboxInfo:
    """Which optional isolation layers :func:`run_python` uses on this machine."""

    python: str
    drops_privileges: bool
    nproc_limited: bool
    network_namespace: bool
    bwrap: str | None = None  # the bubblewrap binary, when it works here
    bwrap_python: str | None = None  # the interpreter run inside bubblewrap
    bwrap_problem: str = ""  # why bubblewrap cannot be used, when it cannot


# The trusted prelude. Runs as ``python -I -B -c _RUNNER <json config>``; everything before
# ``exec(code, ...)`` is ours, everything after is untrusted.
_RUNNER = r'''
import builtins, json, os, resource, sys, traceback
_exit, _read, _write = os._exit, os.read, os.write
cfg = json.loads(sys.argv[1])
try:
    with open(cfg["path"], encoding="utf-8") as f:
        src = f.read()
except BaseException:
    traceback.print_exc()
    _exit(3)

if cfg["netns"]:
    try:
        if hasattr(os, "unshare"):
            os.unshare(os.CLONE_NEWNET)
        else:
            import ctypes
            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)
    except Exception:
        pass

def _limit(which, value):
    try:
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError):
        pass

_limit(resource.RLIMIT_AS, cfg["memory_bytes"])
_limit(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
_limit(resource.RLIMIT_CORE, 0)
try:
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
except (ValueError, OSError):
    pass

if cfg["uid"] is not None:
    os.chown(".", cfg["uid"], cfg["gid"])
    os.setgroups([])
    os.setgid(cfg["gid"])
    os.setuid(cfg["uid"])
if cfg["nproc"] is not None:
    _limit(resource.RLIMIT_NPROC, cfg["nproc"])

def _guard():
    import shutil, socket, subprocess
    def blocked(name):
        def f(*args, **kwargs):
            raise PermissionError(name + " is disabled in the sandbox")
        return f
    for name in (
        "fork", "forkpty", "vfork", "system", "popen", "kill", "killpg", "setsid", "setpgid",
        "setpgrp", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
        "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
        "spawnvpe", "posix_spawn", "posix_spawnp", "_exit", "abort", "putenv", "unsetenv",
        "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate",
        "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "link", "symlink", "chroot",
        "setuid", "seteuid", "setreuid", "setresuid", "setgid", "setegid", "setregid",
        "setresgid", "nice",
    ):
        if hasattr(os, name):
            setattr(os, name, blocked("os." + name))
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput",
                 "getstatusoutput", "_fork_exec", "_posixsubprocess"):
        if hasattr(subprocess, name):
            setattr(subprocess, name, blocked("subprocess." + name))
    for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd",
                 "SocketType", "_socket"):
        if hasattr(socket, name):
            setattr(socket, name, blocked("socket." + name))
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, blocked("shutil." + name))
    for mod in ("ctypes", "_ctypes", "_posixsubprocess", "multiprocessing", "_multiprocessing",
                "_socket", "ssl", "_ssl", "pty", "resource"):
        sys.modules[mod] = None
    builtins.exit = builtins.quit = blocked("exit")
    builtins.help = blocked("help")

if cfg["guard"]:
    _guard()
del _guard, _limit

globals_ = {"__name__": "__main__", "__builtins__": builtins, "__file__": cfg["path"]}
try:
    exec(compile(src, cfg["path"], "exec"), globals_)
except BaseException:
    try:
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        _exit(1)
try:
    sys.stdout.flush()
    sys.stderr.flush()
    token = _read(cfg["token_fd"], 64)  # only now: the code above ran to its end
    _write(cfg["result_fd"], token)
except BaseException:
    _exit(1)
_exit(0)
'''


def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    *,
    max_processes: int = 16,
    output_limit_bytes: int = 1 << 20,
    guard: bool = True,
    python: str | None = None,
    unsafe_exec: bool = False,
    isolation: str | None = None,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a sandboxed ``python -I`` subprocess (see module doc).

    Args:
        code: Python source; it passes if it runs to the end without raising.
        timeout_s: wall-clock limit; the whole process group is killed when it is hit.
        memory_mb: address-space limit (``RLIMIT_AS``) of the child.
        max_processes: ``RLIMIT_NPROC`` headroom where it is enforceable (non-root child).
        output_limit_bytes: largest file (including stdout/stderr) the child may write.
        guard: install the reliability prelude; ``False`` only to test the OS-level layers.
        python: interpreter to use without bubblewrap (default: ``sys.executable``).
        unsafe_exec: where bubblewrap cannot run, run with the process-level layers only
            instead of raising :class:`SandboxUnavailable`.
        isolation: ``"bwrap"`` or ``"process"`` (the latter needs ``unsafe_exec``); default:
            ``"bwrap"`` where it works, else ``"process"`` if ``unsafe_exec``.

    Returns:
        A :class:`SandboxResult`. Never raises for anything the code does.

    Raises:
        SandboxUnavailable: bubblewrap is needed (see above) and cannot run here.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb <= 0:
        raise ValueError(f"memory_mb must be > 0, got {memory_mb}")
    exe = python or sys.executable
    info = sandbox_info(exe)
    isolation = isolation or check_isolation(unsafe_exec, info)
    if isolation == "process" and not unsafe_exec:
        raise SandboxUnavailable("isolation 'process' runs untrusted code without the OS sandbox; "
                                 "it needs unsafe_exec=True (--unsafe-exec)")
    if isolation == "bwrap" and info.bwrap is None:
        raise SandboxUnavailable(_no_bwrap_message(info))
    boxed = isolation == "bwrap"
    workdir = Path(tempfile.mkdtemp(prefix="dlm-sandbox-"))
    token_r, token_w = os.pipe()
    result_r, result_w = os.pipe()
    try:
        src_path = workdir / "solution.py"
        src_path.write_text(code, encoding="utf-8")
        uid = gid = None
        if (boxed and os.geteuid() == 0) or (not boxed and info.drops_privileges):
            entry = pwd.getpwnam(_SANDBOX_USER)
            uid, gid = entry.pw_uid, entry.pw_gid
        nproc = None
        if uid is not None:
            nproc = max_processes + _count_tasks(uid)
        elif os.geteuid() != 0:
            nproc = max_processes + _count_tasks(os.getuid())
        inside = Path("/sandbox") if boxed else workdir
        cfg = {
            "path": str(inside / src_path.name),
            "memory_bytes": int(memory_mb) << 20,
            "fsize_bytes": int(output_limit_bytes),
            "cpu_s": int(timeout_s) + 1,
            "uid": None if boxed else uid,  # bwrap itself starts as that user
            "gid": None if boxed else gid,
            "nproc": nproc,
            "netns": info.network_namespace and not boxed,
            "guard": guard,
            "token_fd": token_r,
            "result_fd": result_w,
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(inside),
            "TMPDIR": "/tmp" if boxed else str(workdir),
        }
        argv = [info.bwrap_python if boxed else exe, "-I", "-B", "-c", _RUNNER, json.dumps(cfg)]
        popen: dict = {}
        if boxed:
            if uid is not None:
                os.chown(workdir, uid, gid)
                os.chown(src_path, uid, gid)
                popen = {"user": uid, "group": gid, "extra_groups": []}
            argv = _bwrap_argv(info, workdir, env) + argv
        token = os.urandom(16).hex().encode()
        os.write(token_w, token)  # 32 bytes: fits any pipe buffer, never blocks
        out_path, err_path = workdir / ".stdout", workdir / ".stderr"
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            start = time.monotonic()
            proc = subprocess.Popen(
                argv,
                cwd="/" if boxed else workdir,
                stdin=subprocess.DEVNULL,
                stdout=out_f,
                stderr=err_f,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=(token_r, result_w),
                **popen,
            )
            os.close(token_r)
            os.close(result_w)
            os.close(token_w)
            token_r = result_w = token_w = -1
            try:
                timed_out = not _wait_unreaped(proc.pid, timeout_s)
            finally:
                # Kill the group while the leader is a zombie or alive: the pgid is still ours.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                returncode = proc.wait()
            duration = time.monotonic() - start
        reported = _read_available(result_r, len(token) + 1)
        return SandboxResult(
            passed=(returncode == 0 and not timed_out and reported == token),
            returncode=returncode,
            timed_out=timed_out,
            stderr_tail=_tail(err_path),
            stdout_tail=_tail(out_path),
            duration_s=duration,
        )
    finally:
        for fd in (token_r, token_w, result_r, result_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)


def check_isolation(unsafe_exec: bool = False, info: SandboxInfo | None = None) -> str:
    """``"bwrap"`` where bubblewrap works; else ``"process"`` if ``unsafe_exec``, else raise
    :class:`SandboxUnavailable` naming the problem and both ways out."""
    info = info or sandbox_info()
    if info.bwrap is not None:
        return "bwrap"
    if unsafe_exec:
        return "process"
    raise SandboxUnavailable(_no_bwrap_message(info))


def _no_bwrap_message(info: SandboxInfo) -> str:
    return (f"refusing to run untrusted code: the bubblewrap sandbox is not usable here ({info.bwrap_problem}). "
            "Install it (Debian/Ubuntu: apt-get install bubblewrap) or, on a throw-away machine, pass "
            "--unsafe-exec (task argument unsafe_exec: true) to run with process-level limits only")


def _bwrap_argv(info: SandboxInfo, workdir: Path, env: dict[str, str]) -> list[str]:
    """The bubblewrap command line up to (not including) the interpreter."""
    assert info.bwrap is not None and info.bwrap_python is not None
    argv = [info.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = _prefix_of(info.bwrap_python)
    if not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", str(workdir), "/sandbox",
             "--chdir", "/sandbox", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv


def _prefix_of(python: str) -> str:
    """The installation folder of an interpreter (``.../bin/python3`` -> ``...``)."""
    return str(Path(os.path.realpath(python)).parent.parent)


def _read_available(fd: int, limit: int) -> bytes:
    """What is in a pipe now, up to ``limit`` bytes (never waits: an escaped process may hold it)."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < limit:
        try:
            chunk = os.read(fd, limit - len(data))
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


@functools.lru_cache(maxsize=None)
def sandbox_info(python: str | None = None) -> SandboxInfo:
    """Which optional layers apply for interpreter ``python`` (default ``sys.executable``).

    Cached; the first call runs the interpreter once (~20 ms) to read its ``sys.path`` and,
    as root, to try ``unshare(CLONE_NEWNET)``.
    """
    exe = python or sys.executable
    is_root = os.geteuid() == 0
    probe = _probe(exe, try_netns=is_root)
    drops = False
    if is_root and probe is not None:
        try:
            pwd.getpwnam(_SANDBOX_USER)
        except KeyError:
            pass
        else:
            targets = [os.path.realpath(exe)] + [
                os.path.realpath(p) for p in probe["path"] if p and os.path.isdir(p)
            ]
            drops = all(_others_can_reach(t) for t in targets)
    bwrap, bwrap_python, problem = _probe_bwrap(exe, is_root)
    return SandboxInfo(
        python=exe,
        drops_privileges=drops,
        nproc_limited=drops or not is_root,
        network_namespace=bool(probe and probe["netns"]),
        bwrap=bwrap,
        bwrap_python=bwrap_python,
        bwrap_problem=problem,
    )


def _probe_bwrap(exe: str, is_root: bool) -> tuple[str | None, str | None, str]:
    """``(bwrap, python, "")`` when bubblewrap runs ``python`` here, else ``(None, None, why)``.

    As root the sandbox starts as ``nobody``, so the interpreter must be reachable by others: the
    one of ``exe`` if it is (a venv's base interpreter), else the system ``/usr/bin/python3``.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, None, "no 'bwrap' on PATH"
    python = os.path.realpath(exe)
    if is_root and not _others_can_reach(os.path.join(_prefix_of(python), "lib")):
        if not os.path.exists(_SYSTEM_PYTHON):
            return None, None, f"{python} is not readable by '{_SANDBOX_USER}' and there is no {_SYSTEM_PYTHON}"
        python = _SYSTEM_PYTHON
    kwargs: dict = {}
    if is_root:
        entry = pwd.getpwnam(_SANDBOX_USER)
        kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    info = SandboxInfo(python=exe, drops_privileges=False, nproc_limited=False, network_namespace=False,
                       bwrap=bwrap, bwrap_python=python)
    probe_dir = Path(tempfile.mkdtemp(prefix="dlm-sandbox-probe-"))
    try:
        if is_root:
            os.chown(probe_dir, kwargs["user"], kwargs["group"])
        argv = _bwrap_argv(info, probe_dir, {"PATH": "/usr/bin:/bin"}) + [python, "-I", "-c", "print('ok')"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              cwd="/", **kwargs)
    except (OSError, subprocess.SubprocessError, KeyError) as err:
        return None, None, f"bwrap could not start: {err}"
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    if done.returncode != 0 or done.stdout.strip() != "ok":
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return None, None, f"bwrap failed a trial run: {why}"
    return bwrap, python, ""


_PROBE = r"""
import json, os, sys
ok = False
if sys.argv[1] == "1":
    try:
        if hasattr(os, "unshare"):
            os.unshare(os.CLONE_NEWNET)
            ok = True
        else:
            import ctypes
            ok = ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0
    except Exception:
        ok = False
print(json.dumps({"path": sys.path, "netns": ok}))
"""


def _probe(exe: str, try_netns: bool) -> dict | None:
    """Run ``exe -I`` once: its ``sys.path`` and whether it may create a network namespace."""
    try:
        out = subprocess.run(
            [exe, "-I", "-c", _PROBE, "1" if try_netns else "0"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            stdin=subprocess.DEVNULL,
        ).stdout
        return json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _others_can_reach(path: str) -> bool:
    """Every ancestor is world-searchable and ``path`` itself is world-readable."""
    p = Path(path)
    try:
        for ancestor in list(p.parents):
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(p).st_mode
    except OSError:
        return False
    need = stat.S_IROTH | stat.S_IXOTH
    return mode & need == need


def _count_tasks(uid: int | None) -> int:
    """Threads currently owned by ``uid`` (what ``RLIMIT_NPROC`` counts), best effort."""
    total = 0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[17])  # num_threads (field 20 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` exits without reaping it; ``False`` on timeout."""
    deadline = time.monotonic() + timeout_s
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return _exited(pid)
                    ready, _, _ = select.select([fd], [], [], left)
                    if ready:
                        return True
            finally:
                os.close(fd)
    delay = 0.001
    while not _exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def _exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * _TAIL_CHARS))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")[-_TAIL_CHARS:]
