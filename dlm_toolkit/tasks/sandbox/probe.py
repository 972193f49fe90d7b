"""What isolation this machine allows: bubblewrap, per-run uids, a network namespace (probed once).

:func:`sandbox_info` tries each layer for real (a bubblewrap trial run under a leased uid, the
interpreter's ``sys.path`` and an ``unshare(CLONE_NEWNET)``) and caches the answer per interpreter;
:func:`check_isolation` turns it into ``"bwrap"`` or ``"process"`` or refuses.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from dlm_toolkit.config import ConfigError

from .limits import PoolUnavailable, uid_lease

SYSTEM_PYTHON = "/usr/bin/python3"


class SandboxUnavailable(ConfigError):
    """The OS sandbox cannot run here and the caller did not accept running without it."""


@dataclass(frozen=True)
class SandboxInfo:
    """Which optional isolation layers the sandbox uses on this machine.

    Attributes:
        python: the interpreter probed (used as is without bubblewrap).
        drops_privileges: process mode (``--unsafe-exec``) runs code under a leased uid, not root.
        nproc_limited: ``RLIMIT_NPROC`` is enforced (never for uid 0).
        network_namespace: process mode can move the code into an empty network namespace.
        mount_namespace: process mode can give the code size-limited tmpfs mounts on ``/tmp`` and
            its working folder in a mount namespace of its own (else the host's, bounded per file).
        per_run_uid: each sandboxed process gets a uid of its own (root only; see :mod:`.limits`).
        bwrap: the bubblewrap binary, when it works here.
        bwrap_python: the interpreter run inside bubblewrap.
        bwrap_problem: why bubblewrap cannot be used, when it cannot.
        pool_problem: why no uid could be leased, as root (every one busy, or an unsafe lock
            folder): a moment's state, so such an answer is not cached.
    """

    python: str
    drops_privileges: bool
    nproc_limited: bool
    network_namespace: bool
    per_run_uid: bool = False
    bwrap: str | None = None
    bwrap_python: str | None = None
    bwrap_problem: str = ""
    mount_namespace: bool = False
    pool_problem: str = ""


def check_isolation(unsafe_exec: bool = False, info: SandboxInfo | None = None) -> str:
    """``"bwrap"`` where bubblewrap works; else ``"process"`` if ``unsafe_exec``, else raise
    :class:`SandboxUnavailable` naming the problem and both ways out."""
    info = info or sandbox_info()
    if info.bwrap is not None:
        return "bwrap"
    if unsafe_exec:
        process_interpreter(None if info.python == sys.executable else info.python)
        return "process"
    raise SandboxUnavailable(no_bwrap_message(info))


def process_interpreter(python: str | None = None) -> SandboxInfo:
    """The :class:`SandboxInfo` of the interpreter process mode runs: ``python`` (default
    ``sys.executable``) where the pool's uids can run it, else, when none was named,
    ``/usr/bin/python3``.

    Raises:
        SandboxUnavailable: process mode cannot give the candidate and the test side two
            unprivileged uids here (:func:`process_problem` says why).
    """
    info = sandbox_info(python or sys.executable)
    if info.drops_privileges:
        return info
    if python is None and os.path.exists(SYSTEM_PYTHON):
        system = sandbox_info(SYSTEM_PYTHON)
        if system.drops_privileges:
            return system
    raise SandboxUnavailable(process_problem(info))


def process_problem(info: SandboxInfo) -> str:
    """One line: why process mode cannot run code here under two unprivileged uids, and what to do."""
    head = ("refusing process mode (--unsafe-exec): the candidate and the test side must each run under an "
            "unprivileged uid of their own")
    fix = "install bubblewrap (apt-get install bubblewrap)"
    if os.geteuid() != 0:
        return f"{head}, and only an evaluator running as root can switch uids; run as root or {fix}"
    if not info.per_run_uid:
        return f"{head}, and no uid could be leased from the pool ({info.pool_problem}); free the pool or {fix}"
    return (f"{head}, and those uids cannot read the interpreter {os.path.realpath(info.python)} (a folder on its "
            f"path is closed to other users, e.g. a pyenv under /root) nor {SYSTEM_PYTHON}; install python3 under "
            f"/usr, make the interpreter's folders world-readable, or {fix}")


def no_bwrap_message(info: SandboxInfo) -> str:
    if info.pool_problem:  # bubblewrap may be fine: it needs a uid to run as and none was free
        return f"refusing to run untrusted code: no sandbox uid could be leased to run it as ({info.pool_problem})"
    return (f"refusing to run untrusted code: the bubblewrap sandbox is not usable here ({info.bwrap_problem}). "
            "Install it (Debian/Ubuntu: apt-get install bubblewrap) or, on a throw-away machine, pass "
            "--unsafe-exec on the command line (dlm eval, dlm sweep, dlm replay; never a task argument or a file) "
            "to run with process-level limits only")


def bwrap_argv(info: SandboxInfo, env: dict[str, str], tmp_bytes: int = 64 << 20,
               workdir_bytes: int = 64 << 20, ro_binds: tuple[str, ...] = ()) -> list[str]:
    """The bubblewrap command line up to (not including) the interpreter.

    New user, PID, network, mount, IPC, UTS and cgroup namespaces; every capability dropped; an
    empty tmpfs root holding ``/usr`` and the interpreter's prefix read-only; ``/tmp`` and the
    working folder ``/sandbox`` are tmpfs mounts of ``tmp_bytes`` and ``workdir_bytes`` inside the
    sandbox (nothing written there reaches the host, nothing is left when it ends); killed with
    its parent; a new session (no terminal)."""
    assert info.bwrap is not None and info.bwrap_python is not None
    argv = [info.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(int(tmp_bytes)), "--perms", "1777", "--tmpfs", "/tmp",
             "--size", str(int(workdir_bytes)), "--perms", "0700", "--tmpfs", "/sandbox"]
    # bubblewrap mounts in order: the read-only binds come after the tmpfs mounts, so an interpreter or a
    # library folder under /tmp (a checkout or venv there) is bound over the empty tmpfs, not hidden by it
    prefix = prefix_of(info.bwrap_python)
    if not prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    for folder in ro_binds:
        argv += ["--ro-bind", folder, folder]
    argv += ["--chdir", "/sandbox", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv


def prefix_of(python: str) -> str:
    """The installation folder of an interpreter (``.../bin/python3`` -> ``...``)."""
    return str(Path(os.path.realpath(python)).parent.parent)


_PROBED: dict[str, SandboxInfo] = {}


def sandbox_info(python: str | None = None) -> SandboxInfo:
    """Which optional layers apply for interpreter ``python`` (default ``sys.executable``).

    Cached per interpreter (``sandbox_info()`` and ``sandbox_info(sys.executable)`` are one entry,
    so a task's probe is its runner's); the first call runs the interpreter once (~20 ms) to read
    its ``sys.path`` and, as root, to try ``unshare(CLONE_NEWNET)``, and bubblewrap once (~50 ms).
    An answer given while no pool uid was free is not kept: the next call probes again.
    """
    exe = python or sys.executable
    info = _PROBED.get(exe)
    if info is None:
        info = _probe_layers(exe)
        if not info.pool_problem:
            _PROBED[exe] = info
    return info


sandbox_info.cache_clear = _PROBED.clear  # type: ignore[attr-defined]  # as an lru_cache's, for tests


def _probe_layers(exe: str) -> SandboxInfo:
    is_root = os.geteuid() == 0
    probe = _probe(exe, try_netns=is_root)
    pool, pool_problem = False, ""
    if is_root:
        try:
            with uid_lease():
                pool = True
        except PoolUnavailable as err:
            pool_problem = str(err)
    drops = False
    if pool and probe is not None:
        targets = [os.path.realpath(exe)] + [os.path.realpath(p) for p in probe["path"] if p and os.path.isdir(p)]
        drops = all(others_can_reach(t) for t in targets)
    bwrap, bwrap_python, problem = _probe_bwrap(exe, is_root, pool)
    return SandboxInfo(
        python=exe,
        drops_privileges=drops,
        nproc_limited=drops or not is_root,
        network_namespace=bool(probe and probe["netns"]),
        mount_namespace=bool(probe and probe.get("mountns")),
        per_run_uid=pool,
        bwrap=bwrap,
        bwrap_python=bwrap_python,
        bwrap_problem=problem,
        pool_problem=pool_problem,
    )


def _probe_bwrap(exe: str, is_root: bool, pool: bool) -> tuple[str | None, str | None, str]:
    """``(bwrap, python, "")`` when bubblewrap runs ``python`` here, else ``(None, None, why)``.

    As root the sandbox starts as a leased unprivileged uid, so the interpreter must be reachable
    by others: the one of ``exe`` if it is (a venv's base interpreter), else ``/usr/bin/python3``.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, None, "no 'bwrap' on PATH"
    if is_root and not pool:
        return None, None, "no unprivileged uid could be leased to run it as (see dlm_toolkit/tasks/sandbox/limits.py)"
    python = os.path.realpath(exe)
    if is_root and not others_can_reach(os.path.join(prefix_of(python), "lib")):
        if not os.path.exists(SYSTEM_PYTHON):
            return None, None, f"{python} is not readable by unprivileged users and there is no {SYSTEM_PYTHON}"
        python = SYSTEM_PYTHON
    info = SandboxInfo(python=exe, drops_privileges=False, nproc_limited=False, network_namespace=False,
                       bwrap=bwrap, bwrap_python=python)
    try:
        with ExitStack() as stack:
            kwargs: dict = {}
            if is_root:
                uid = stack.enter_context(uid_lease())
                kwargs = {"user": uid, "group": uid, "extra_groups": []}
            argv = bwrap_argv(info, {"PATH": "/usr/bin:/bin"}) + [python, "-I", "-c", "print('ok')"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                                  cwd="/", **kwargs)
    except (OSError, subprocess.SubprocessError, PoolUnavailable) as err:
        return None, None, f"bwrap could not start: {err}"
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
mnt = False
if sys.argv[1] == "1":
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        # a mount namespace of our own and a tmpfs in it (what process mode's runner does)
        mnt = (libc.unshare(0x00020000) == 0 and libc.mount(b"none", b"/", None, 0x4000 | (1 << 18), None) == 0
               and libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, b"size=1048576") == 0)
    except Exception:
        mnt = False
print(json.dumps({"path": sys.path, "netns": ok, "mountns": mnt}))
"""


def _probe(exe: str, try_netns: bool) -> dict | None:
    """Run ``exe -I`` once: its ``sys.path`` and whether it may create a network namespace."""
    try:
        out = subprocess.run([exe, "-I", "-c", _PROBE, "1" if try_netns else "0"], capture_output=True, text=True,
                             timeout=60, check=True, stdin=subprocess.DEVNULL).stdout
        return json.loads(out)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def others_can_reach(path: str) -> bool:
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
