"""One sandboxed interpreter: its uid, working folder, limits, command line, lifetime and output.

:class:`SandboxProcess` starts ``python -I -B -c <bootstrap>`` under bubblewrap or, in process mode,
as a plain child in a new session, and kills its whole process group (and every process of its
leased uid) when it is stopped.

Nothing the harness reads back is ever named by a path the code could change. The runner's
source and its config (pipe fd numbers, the entry point) arrive on stdin from an anonymous
in-memory file, which the bootstrap replaces with ``/dev/null`` before anything untrusted runs:
the command line (world-readable in ``/proc/<pid>/cmdline``) holds only the fixed bootstrap.
stdout and stderr go to anonymous in-memory files (``memfd_create``) opened before the start; the
harness keeps its own descriptor and reads at most the last ``4 * TAIL_CHARS`` bytes with
``pread`` after checking with ``fstat`` that it is a regular file. The code may write, truncate or
close its ends; it can never make the harness open a symlink, a FIFO or a device.

The code files travel in the config too. Under bubblewrap the working folder ``/sandbox`` and
``/tmp`` are size-limited tmpfs mounts inside the sandbox's own mount namespace; in process mode
as root, where the kernel allows a mount namespace (:attr:`.SandboxInfo.mount_namespace`), the
runner mounts the same two (``/tmp`` and ``/tmp/sandbox``) before dropping privileges. Either
way nothing the code writes lands on the host, and nothing is left when its last process dies,
whatever signal ends the run. Otherwise process mode has a host folder, which
:func:`remove_tree` removes whatever it holds.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import select
import signal
import stat
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from .cgroup import run_cgroup
from .limits import count_tasks, kill_uid, uid_lease
from .probe import SandboxInfo, SandboxUnavailable, bwrap_argv, process_problem

TAIL_CHARS = 4000
PRIVATE_WORKDIR = "/tmp/sandbox"  # process mode's working folder, a tmpfs inside its private /tmp
_MARKER = "# ---- the sandbox runs what follows, after protocol.py's source ----"

# Reads the config line and the runner's source from stdin, then puts /dev/null there: the
# in-memory file that carried them is gone from the process before any untrusted byte runs.
BOOTSTRAP = (
    "import os,sys\n"
    "_b=sys.stdin.buffer.read()\n"
    "_n=os.open('/dev/null',os.O_RDONLY)\n"
    "os.dup2(_n,0)\n"
    "os.close(_n)\n"
    "_c,_,_s=_b.partition(b'\\n')\n"
    "del _b\n"
    "exec(compile(_s,'<dlm-sandbox-runner>','exec'),{'__name__':'__dlm_runner__','_CFG':_c})\n"
)


@functools.lru_cache(maxsize=1)
def runner_source() -> str:
    """The program every sandboxed interpreter runs: the protocol, then ``inside.py`` below its marker."""
    here = Path(__file__).parent
    protocol = (here / "protocol.py").read_text(encoding="utf-8")
    inside = (here / "inside.py").read_text(encoding="utf-8")
    return protocol + "\n" + inside[inside.index(_MARKER):]


def memfd(name: str, data: bytes = b"") -> int:
    """An anonymous in-memory regular file holding ``data``, positioned at its start (close-on-exec)."""
    fd = os.memfd_create(f"dlm-sandbox-{name}", os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SandboxProcess:
    """A started sandboxed interpreter; use as a context manager (leaving it kills and cleans up).

    Args:
        mode: ``script``, ``candidate`` or ``tests`` (see ``inside.py``).
        files: code files by role (``code``, ``solution``, ``tests``): they travel in the config and the
            runner writes them to ``<role>.py`` in its working folder.
        fds: pipe ends the child keeps, by config key (``token_fd``, ``requests_fd``, ...).
        boxed: under bubblewrap (else process mode, which needs root and a leased uid).
        info: this machine's :class:`~.probe.SandboxInfo`.
        exe: the interpreter in process mode.
        tmp_mb, workdir_mb: sizes of the ``/tmp`` and working-folder tmpfs; the working folder gets
            the code files' size on top (large test files do not eat the code's share).
        extra: more runner config (``entry_point``).
    """

    def __init__(self, *, mode: str, files: dict[str, str], fds: dict[str, int], boxed: bool, info: SandboxInfo,
                 exe: str, timeout_s: float, memory_mb: int, max_processes: int, output_limit_bytes: int,
                 guard: bool, extra: dict | None = None, tmp_mb: int = 64, workdir_mb: int = 64,
                 ro_binds: tuple[str, ...] = ()) -> None:
        self._stack = ExitStack()
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None
        self._out = self._err = -1
        self._uid: int | None = None
        try:
            self._start(mode, files, fds, boxed, info, exe, timeout_s, memory_mb, max_processes,
                        output_limit_bytes, guard, extra or {}, tmp_mb, workdir_mb, tuple(ro_binds))
        except BaseException:
            self.close()
            raise

    def _start(self, mode: str, files: dict[str, str], fds: dict[str, int], boxed: bool, info: SandboxInfo,
               exe: str, timeout_s: float, memory_mb: int, max_processes: int, output_limit_bytes: int,
               guard: bool, extra: dict, tmp_mb: int, workdir_mb: int, ro_binds: tuple[str, ...] = ()) -> None:
        tmp_bytes = int(tmp_mb) << 20
        workdir_bytes = (int(workdir_mb) << 20) + sum(len(text.encode("utf-8")) for text in files.values())
        if os.geteuid() == 0:
            uid: int | None = self._stack.enter_context(uid_lease())
            self._uid = uid
            total = (int(memory_mb) << 20) + tmp_bytes + workdir_bytes + 2 * int(output_limit_bytes)
            procs: str | None = self._stack.enter_context(run_cgroup(f"dlm-sandbox-{uid}", total))
        elif boxed:
            uid = procs = None  # bubblewrap's user namespace; the run shares this user's process budget
        else:
            raise SandboxUnavailable(process_problem(info))
        if not boxed and not info.drops_privileges:
            raise SandboxUnavailable(process_problem(info))
        private = boxed or info.mount_namespace  # /tmp and the working folder are tmpfs of the run's own
        inside = "/sandbox" if boxed else PRIVATE_WORKDIR if private else self._workdir()
        paths = {name: f"{inside}/{name}.py" for name in files}
        if uid is not None:
            nproc: int | None = max_processes  # a fresh uid: the run's processes are all it has
        else:
            nproc = max_processes + count_tasks(os.getuid())  # shared with everything else of this user
        cfg = {
            "mode": mode,
            "paths": paths,
            "sources": files,
            "memory_bytes": int(memory_mb) << 20,
            "fsize_bytes": int(output_limit_bytes),
            "cpu_s": int(timeout_s) + 1,
            "uid": None if boxed else uid,  # bubblewrap itself starts as that uid
            "parent": os.getpid(),
            "cgroup_procs": None if boxed else procs,  # bubblewrap is moved in by us, through the gate
            "nproc": nproc,
            "netns": info.network_namespace and not boxed,
            "mounts": [] if boxed or not private else [
                ["/tmp", tmp_bytes, "1777"], [inside, workdir_bytes, "0700"]],
            "guard": guard,
            **fds,
            **extra,
        }
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": inside,
            "TMPDIR": "/tmp" if private else inside,
        }
        blob = json.dumps(cfg).encode() + b"\n" + runner_source().encode("utf-8")
        opened: list[int] = []
        try:
            opened.append(stdin := memfd("runner", blob))
            self._out, self._err = memfd("stdout"), memfd("stderr")
            argv = [info.bwrap_python if boxed else exe, "-I", "-B", "-c", BOOTSTRAP]
            popen: dict = {}
            pass_fds = list(fds.values())
            gate = -1
            if boxed:
                argv = bwrap_argv(info, env, tmp_bytes=tmp_bytes, workdir_bytes=workdir_bytes, ro_binds=ro_binds) + argv
                if uid is not None:
                    popen = {"user": uid, "group": uid, "extra_groups": []}
                if procs is not None:  # wait on stdin until we moved the shell into the group, then exec bubblewrap
                    gate_r, gate = os.pipe()
                    opened += [gate_r, gate]
                    pass_fds.append(stdin)
                    argv = ["/bin/sh", "-c", f'read go && exec "$@" </dev/fd/{stdin}', "sh", *argv]
                    stdin = gate_r
            self.proc = subprocess.Popen(argv, cwd="/" if private else inside, stdin=stdin, stdout=self._out,
                                         stderr=self._err, env=env, start_new_session=True, close_fds=True,
                                         pass_fds=tuple(pass_fds), **popen)
            if gate >= 0:
                try:
                    with open(procs, "w") as f:
                        f.write(str(self.proc.pid))
                except OSError as err:
                    raise SandboxUnavailable(f"could not move the sandbox into its memory cgroup {procs}: "
                                             f"{err.strerror}") from None
                os.write(gate, b"go\n")
        finally:
            for fd in opened:
                os.close(fd)

    def _workdir(self) -> str:
        """Process mode without a mount namespace: a fresh root-only folder on the host (the runner
        writes the code files and hands it to the run's uid), removed when the run ends whatever it
        holds then."""
        workdir = tempfile.mkdtemp(prefix="dlm-sandbox-")
        self._stack.callback(self._remove_workdir, workdir)  # before the lease ends (LIFO)
        return workdir

    def _remove_workdir(self, workdir: str) -> None:
        # Whatever escaped the process group dies first: remove_tree walks up through '..', which
        # a live process could redirect by moving folders; and the uid is still ours, so no other
        # run's code can reach the folder meanwhile.
        if self._uid is not None:
            kill_uid(self._uid)
        remove_tree(workdir)

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
        return tail_fd(self._out), tail_fd(self._err)

    def close(self) -> None:
        """Stop, remove the working folder, end the uid lease (killing whatever still runs under it)."""
        try:
            self.stop()
        finally:
            try:
                self._stack.close()
            finally:
                for fd in (self._out, self._err):
                    if fd >= 0:
                        os.close(fd)
                self._out = self._err = -1

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


def tail_fd(fd: int) -> str:
    """The last ~:data:`TAIL_CHARS` characters of the regular file open at ``fd`` (``""`` for anything
    else); reads at most ``4 * TAIL_CHARS`` bytes whatever size the file claims."""
    if fd < 0:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        data = os.pread(fd, 4 * TAIL_CHARS, max(0, st.st_size - 4 * TAIL_CHARS))
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a folder sandboxed code could write, whatever it left there, once nothing of it runs
    any more (it walks up through ``..``: a running process could move folders under it).

    Iterative (a 5,000-deep tree is no ``RecursionError``), holding one folder descriptor at a time
    (no ``EMFILE``) and listing each folder once; every entry is opened relative to its parent's
    descriptor with ``O_NOFOLLOW``, so a symlink is unlinked, never followed, and a FIFO or device
    is unlinked, never opened; a folder whose mode blocks listing is given ``0o700`` first. Never
    raises for what the tree holds: an entry that cannot go is left, the rest is removed."""
    try:
        cur = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):  # not a folder (any more): just the name goes
            _quietly(os.unlink, path)
        return
    levels = [("", _empty_but_folders(cur))]  # (name in the parent, sub-folders still to remove)
    try:
        while True:
            pending = levels[-1][1]
            if pending:
                child = pending.pop()
                fd = _open_folder(child, cur)
                if fd >= 0:
                    os.close(cur)
                    cur = fd
                    levels.append((child, _empty_but_folders(cur)))
                continue
            if len(levels) == 1:
                break
            up = os.open("..", _DIR_FLAGS, dir_fd=cur)
            os.close(cur)
            cur = up
            _quietly(os.rmdir, levels.pop()[0], dir_fd=cur)
    finally:
        os.close(cur)
    _quietly(os.rmdir, path)


def _open_folder(name: str, dir_fd: int) -> int:
    """``name`` (a folder in ``dir_fd``) opened without following links, mode mended if it blocks; -1 if not."""
    for attempt in range(2):
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        except PermissionError:
            if attempt == 0:
                _quietly(os.chmod, name, 0o700, dir_fd=dir_fd)  # a folder (the tree no longer changes)
        except OSError:
            break
    return -1


def _empty_but_folders(fd: int) -> list[str]:
    """Unlink every entry of the folder open at ``fd`` that is not a folder; the sub-folders' names."""
    if not os.stat(fd).st_mode & stat.S_IRUSR:
        _quietly(os.chmod, fd, 0o700)
    folders = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                except OSError:
                    is_dir = False
                if is_dir:
                    folders.append(entry.name)
                else:
                    _quietly(os.unlink, entry.name, dir_fd=fd)
    except OSError:
        pass
    return folders


def _quietly(func, *args, **kwargs) -> None:
    try:
        func(*args, **kwargs)
    except OSError:
        pass
