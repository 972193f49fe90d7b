"""One sandboxed interpreter: its uid, working folder, limits, command line, lifetime and output.

:class:`SandboxProcess` starts ``python -I -B -c <runner>`` (the runner is ``protocol.py`` +
``inside.py``) under bubblewrap or, in process mode, as a plain child in a new session, and kills
its whole process group (and, as root, every process of its leased uid) when it is stopped.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from .limits import count_tasks, uid_lease
from .probe import SandboxInfo, bwrap_argv

TAIL_CHARS = 4000
_MARKER = "# ---- the sandbox runs what follows, after protocol.py's source ----"


@functools.lru_cache(maxsize=1)
def runner_source() -> str:
    """The program every sandboxed interpreter runs: the protocol, then ``inside.py`` below its marker."""
    here = Path(__file__).parent
    protocol = (here / "protocol.py").read_text(encoding="utf-8")
    inside = (here / "inside.py").read_text(encoding="utf-8")
    return protocol + "\n" + inside[inside.index(_MARKER):]


class SandboxProcess:
    """A started sandboxed interpreter; use as a context manager (leaving it kills and cleans up).

    Args:
        mode: ``script``, ``candidate`` or ``tests`` (see ``inside.py``).
        files: code files by role (``code``, ``solution``, ``tests``): written to the working folder.
        fds: pipe ends the child keeps, by config key (``token_fd``, ``requests_fd``, ...).
        boxed: under bubblewrap (else process mode).
        info: this machine's :class:`~.probe.SandboxInfo`.
        exe: the interpreter in process mode.
        extra: more runner config (``entry_point``).
        ro_binds: host folders mounted read-only under bubblewrap (a library environment).
    """

    def __init__(self, *, mode: str, files: dict[str, str], fds: dict[str, int], boxed: bool, info: SandboxInfo,
                 exe: str, timeout_s: float, memory_mb: int, max_processes: int, output_limit_bytes: int,
                 guard: bool, extra: dict | None = None, ro_binds: tuple[str, ...] = ()) -> None:
        self._stack = ExitStack()
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        try:
            self._start(mode, files, fds, boxed, info, exe, timeout_s, memory_mb, max_processes,
                        output_limit_bytes, guard, extra or {}, tuple(ro_binds))
        except BaseException:
            self.close()
            raise

    def _start(self, mode: str, files: dict[str, str], fds: dict[str, int], boxed: bool, info: SandboxInfo,
               exe: str, timeout_s: float, memory_mb: int, max_processes: int, output_limit_bytes: int,
               guard: bool, extra: dict, ro_binds: tuple[str, ...] = ()) -> None:
        root = os.geteuid() == 0
        uid = None
        if root and (boxed or info.drops_privileges):
            uid = self._stack.enter_context(uid_lease())
        workdir = Path(tempfile.mkdtemp(prefix="dlm-sandbox-"))
        self._stack.callback(shutil.rmtree, workdir, True)  # before the lease ends (LIFO)
        inside = Path("/sandbox") if boxed else workdir
        paths = {}
        for name, text in files.items():
            (workdir / f"{name}.py").write_text(text, encoding="utf-8")
            paths[name] = str(inside / f"{name}.py")
        if uid is not None:
            nproc: int | None = max_processes  # a fresh uid: the run's processes are all it has
        elif not root:
            nproc = max_processes + count_tasks(os.getuid())  # shared with everything else of this user
        else:
            nproc = None  # root in process mode, interpreter unreachable by others: unenforceable
        cfg = {
            "mode": mode,
            "paths": paths,
            "memory_bytes": int(memory_mb) << 20,
            "fsize_bytes": int(output_limit_bytes),
            "cpu_s": int(timeout_s) + 1,
            "uid": None if boxed else uid,  # bubblewrap itself starts as that uid
            "nproc": nproc,
            "netns": info.network_namespace and not boxed,
            "guard": guard,
            **fds,
            **extra,
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": str(inside),
            "TMPDIR": "/tmp" if boxed else str(workdir),
        }
        argv = [info.bwrap_python if boxed else exe, "-I", "-B", "-c", runner_source(), json.dumps(cfg)]
        popen: dict = {}
        if boxed:
            if uid is not None:
                os.chown(workdir, uid, uid)
                for name in files:
                    os.chown(workdir / f"{name}.py", uid, uid)
                popen = {"user": uid, "group": uid, "extra_groups": []}
            argv = bwrap_argv(info, workdir, env, ro_binds) + argv
        self.out_path, self.err_path = workdir / ".stdout", workdir / ".stderr"
        with open(self.out_path, "wb") as out_f, open(self.err_path, "wb") as err_f:
            self.proc = subprocess.Popen(argv, cwd="/" if boxed else workdir, stdin=subprocess.DEVNULL, stdout=out_f,
                                         stderr=err_f, env=env, start_new_session=True, close_fds=True,
                                         pass_fds=tuple(fds.values()), **popen)

    def wait(self, deadline: float) -> bool:
        """Wait (without reaping) until the process exits or ``deadline`` (``time.monotonic``)."""
        assert self.proc is not None
        return wait_unreaped(self.proc.pid, deadline)

    def stop(self) -> int | None:
        """Kill the process group while the leader is still un-reaped (its id cannot be reused), reap it."""
        if self.proc is None or self.returncode is not None:
            return self.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.returncode = self.proc.wait()
        return self.returncode

    def tails(self) -> tuple[str, str]:
        """The last ~4000 characters of stdout and of stderr."""
        return tail(self.out_path), tail(self.err_path)

    def close(self) -> None:
        """Stop, remove the working folder, end the uid lease (killing whatever still runs under it)."""
        try:
            self.stop()
        finally:
            self._stack.close()

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits without reaping it; ``False`` at ``deadline``."""
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
                        return exited(pid)
                    ready, _, _ = select.select([fd], [], [], left)
                    if ready:
                        return True
            finally:
                os.close(fd)
    delay = 0.001
    while not exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def exited(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def read_available(fd: int, limit: int) -> bytes:
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


def tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * TAIL_CHARS))
            data = f.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]
