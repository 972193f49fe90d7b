"""The trusted runner every sandboxed interpreter starts with (never imported by the package).

The harness runs ``python -I -B -c <process.BOOTSTRAP>`` with stdin an in-memory file holding the
config (one JSON line) and protocol.py's source + this file below the marker; the bootstrap reads
it and puts ``/dev/null`` on stdin. So nothing of the package has to be readable inside the
sandbox, and nothing of the config (pipe fd numbers) is on the world-readable command line.
Everything before ``exec(...)`` of untrusted code is ours:

1. process mode as root: enter a new network namespace where the kernel allows it, and a mount
   namespace with size-limited tmpfs on ``/tmp`` and the working folder;
2. write the code files (they came in the config) into the working folder;
3. resource limits: ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (files and captured output),
   ``RLIMIT_CORE = 0``, ``RLIMIT_CPU`` (timeout + 1 s);
4. process mode as root: drop to the run's own unprivileged uid (bubblewrap starts as it);
5. ``RLIMIT_NPROC`` (only enforceable once non-root);
6. the reliability guard (replaces process, file and socket functions by ones raising
   ``PermissionError``; defence in depth, not a boundary);
7. the mode:

``script``     run one file as ``__main__``; if it returns normally, echo the harness's token from
               the token pipe to the result pipe (:func:`.run_python`).
``candidate``  run the solution, then serve calls of its ``entry_point`` over two pipes: each
               request's arguments are decoded to fresh plain data, each result encoded; an
               exception crosses as ``[builtin class name, message]``.
``tests``      wait for the candidate's "ready", run the tests with ``entry_point`` bound to a
               proxy that sends the arguments and returns the decoded result, and write the
               verdict to the report pipe, which only the harness reads. With ``call_timeout_s``,
               each call's whole reply must arrive within that many seconds of this side's clock
               (from before the request is sent): a late one fails the run, whatever it holds.
"""

from .protocol import (  # noqa: F401 -- for readers and linters; the sandbox gets protocol.py's source instead
    MAX_TEXT, ChannelClosed, DeadlinePassed, NotPlainData, ProtocolError, decode, encode, exception_name,
    rebuild_exception, receive, send)

raise ImportError("dlm_toolkit.tasks.sandbox.inside is the program sandboxed interpreters run, not a module "
                  "to import (see dlm_toolkit.tasks.sandbox.process.runner_source)")

# ---- the sandbox runs what follows, after protocol.py's source ----
import builtins  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402

_exit, _read, _write = os._exit, os.read, os.write  # noqa: F821 -- os comes with protocol.py's source
cfg = json.loads(_CFG)  # noqa: F821 -- the config line the bootstrap read from stdin (process.BOOTSTRAP)
del _CFG  # noqa: F821


def print_exc():
    """The traceback of the exception being handled, to stderr (traceback costs ~18 ms to import:
    only failures pay for it)."""
    import traceback

    traceback.print_exc()


sources = cfg.pop("sources")

if cfg["netns"]:
    try:
        if hasattr(os, "unshare"):  # noqa: F821 -- Python >= 3.12
            os.unshare(os.CLONE_NEWNET)  # noqa: F821
        else:
            import ctypes
            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)
    except Exception:
        pass


if cfg.get("cgroup_procs"):  # process mode: into the run's memory cgroup while still root (cgroup.py)
    try:
        with open(cfg["cgroup_procs"], "w") as _f:
            _f.write(str(os.getpid()))  # noqa: F821
    except BaseException:
        print_exc()
        _exit(3)

if cfg.get("mounts"):
    # Process mode as root: a mount namespace of our own with size-limited tmpfs on /tmp and on the
    # working folder, so what the code writes never reaches the host's disk or /tmp and vanishes
    # with its last process. The code files go back into the new working folder (tracebacks,
    # __file__). Where the kernel refuses, the host folders stay (sandbox_info probed this first).
    try:
        import ctypes
        _libc = ctypes.CDLL(None, use_errno=True)
        if _libc.unshare(0x00020000) != 0 or _libc.mount(b"none", b"/", None, 0x4000 | (1 << 18), None) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
        for _target, _size, _mode in cfg["mounts"]:  # the working folder may lie in /tmp: made again there
            os.makedirs(_target, mode=0o700, exist_ok=True)  # noqa: F821
            if _libc.mount(b"tmpfs", _target.encode(), b"tmpfs", 2 | 4, f"size={_size},mode={_mode}".encode()) != 0:
                raise OSError(ctypes.get_errno(), "mount tmpfs on " + _target)
        os.chdir(cfg["mounts"][-1][0])  # noqa: F821 -- the working folder is mounted last
        del _libc, _target, _size, _mode
    except BaseException:
        print_exc()
        _exit(3)

try:  # the code files, for tracebacks and __file__ (the working folder is fresh and ours)
    for _name, _path in cfg["paths"].items():
        with open(_path, "x", encoding="utf-8") as _f:
            _f.write(sources[_name])
        if cfg["uid"] is not None:
            os.chown(_path, cfg["uid"], cfg["uid"])  # noqa: F821
except BaseException:
    print_exc()
    _exit(3)


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
    os.chown(".", cfg["uid"], cfg["uid"])  # noqa: F821
    os.setgroups([])  # noqa: F821
    os.setgid(cfg["uid"])  # noqa: F821
    os.setuid(cfg["uid"])  # noqa: F821
    # process mode: die with the evaluator, however it ends (bubblewrap has --die-with-parent). The
    # uid change clears this setting, so it comes after; a parent gone meanwhile ends the run here.
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except BaseException:
        _exit(3)
    if os.getppid() != cfg["parent"]:  # noqa: F821
        _exit(3)
if cfg["nproc"] is not None:
    _limit(resource.RLIMIT_NPROC, cfg["nproc"])


def _guard():
    import shutil
    import socket
    import subprocess

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
        if hasattr(os, name):  # noqa: F821
            setattr(os, name, blocked("os." + name))  # noqa: F821
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


def _compile(name):
    return compile(sources[name], cfg["paths"][name], "exec")


def run_script():
    """Mode ``script``: the code runs as ``__main__``; the token comes back only if it returned."""
    globals_ = {"__name__": "__main__", "__builtins__": builtins, "__file__": cfg["paths"]["code"]}
    try:
        exec(_compile("code"), globals_)
    except BaseException:
        try:
            print_exc()
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


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def serve_candidate():
    """Mode ``candidate``: load the solution, answer ``[seq, args, kwargs]`` requests until EOF."""
    requests, replies, entry = cfg["requests_fd"], cfg["replies_fd"], cfg["entry_point"]
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(_compile("solution"), namespace)
        function = namespace.get(entry)
        if not callable(function):
            raise NameError(f"the solution defines no callable {entry!r}")
    except BaseException as exc:
        print_exc()
        send(replies, {"d": [["load_error", f"{exception_name(exc)}: {str(exc)[:MAX_TEXT]}"]]})
        _exit(1)
    _flush()
    send(replies, {"d": [["ready", True]]})
    while True:
        try:
            request = decode(receive(requests))
        except ChannelClosed:
            _exit(0)
        seq, args, kwargs = request
        try:
            value = function(*args, **kwargs)
        except BaseException as exc:
            try:
                text = str(exc)
            except BaseException:
                text = "<unprintable>"
            reply = {"t": [seq, "raise", exception_name(exc), text[:MAX_TEXT]]}
        else:
            try:
                reply = {"t": [seq, "ok", encode(value)]}
            except NotPlainData as exc:
                reply = {"t": [seq, "bad", str(exc)]}
        _flush()  # the side is killed, not exited, when the tests end: what it printed must be out by then
        try:
            send(replies, reply)
        except NotPlainData as exc:  # a return value over the size limit
            send(replies, {"t": [seq, "bad", str(exc)]})


class CandidateLost(BaseException):
    """The candidate broke the protocol, sent what is not plain data, raised ``SystemExit`` or died.

    A ``BaseException``, so ``except Exception`` in a test does not swallow it; and the run fails
    whatever the tests do with it (the runner remembers it)."""


def run_tests():
    """Mode ``tests``: the benchmark's test code against a proxy of the candidate; verdict to the report pipe."""
    requests, replies, entry = cfg["requests_fd"], cfg["replies_fd"], cfg["entry_point"]
    limit = cfg.get("call_timeout_s")
    state = {"lost": None, "calls": 0}

    def report(passed, reason):
        _write(cfg["report_fd"], json.dumps(  # noqa: F821
            {"passed": passed, "reason": reason[:MAX_TEXT], "calls": state["calls"]}).encode())
        sys.stdout.flush()
        sys.stderr.flush()
        _exit(0)

    def lose(reason):
        if state["lost"] is None:
            state["lost"] = reason
        raise CandidateLost(reason)

    try:
        hello = decode(receive(replies))
    except (ChannelClosed, ProtocolError) as err:
        report(False, f"the candidate did not start: {err}")
    if hello != {"ready": True}:
        report(False, f"the candidate did not load: {hello.get('load_error') if type(hello) is dict else hello!r}")

    def proxy(*args, **kwargs):
        if state["lost"] is not None:
            raise CandidateLost(state["lost"])
        state["calls"] += 1
        seq = state["calls"]
        # the candidate's time, measured here: nothing it runs (a caught signal, a patched clock) reaches it
        deadline = None if limit is None else time.monotonic() + limit  # noqa: F821 -- with protocol.py
        try:
            send(requests, {"t": [seq, encode(list(args)), encode(kwargs)]})
        except NotPlainData as err:
            lose(f"call {seq}: an argument cannot cross to the candidate: {err}")
        except OSError as err:
            lose(f"call {seq}: the candidate is gone ({err})")
        try:
            reply = decode(receive(replies, deadline))
        except DeadlinePassed:
            lose(f"call {seq}: time limit exceeded (no reply within {limit:g} s)")
        except (ChannelClosed, ProtocolError, OSError) as err:
            lose(f"call {seq}: {err}")
        if type(reply) is not tuple or len(reply) < 3 or reply[0] != seq:
            lose(f"call {seq}: a reply out of protocol: {reply!r:.200}")
        if reply[1] == "ok" and len(reply) == 3:
            return reply[2]
        if reply[1] == "raise" and len(reply) == 4:
            exc = rebuild_exception(reply[2], reply[3])
            if exc is None:
                lose(f"call {seq}: the candidate raised {reply[2]!r:.100}")
            raise exc
        if reply[1] == "bad" and len(reply) == 3:
            lose(f"call {seq}: the candidate returned what is not plain data: {reply[2]!r:.300}")
        lose(f"call {seq}: a reply out of protocol: {reply!r:.200}")

    proxy.__name__ = proxy.__qualname__ = entry
    namespace = {"__name__": "__tests__", "__builtins__": builtins, entry: proxy}
    try:
        exec(_compile("tests"), namespace)
    except BaseException as exc:
        print_exc()
        report(False, state["lost"] or f"the tests raised {type(exc).__name__}: {exc}")
    if state["lost"] is not None:  # the tests swallowed a CandidateLost: still a failure
        report(False, state["lost"])
    report(True, "")


{"script": run_script, "candidate": serve_candidate, "tests": run_tests}[cfg["mode"]]()
