"""Run untrusted Python (model-written code) in throw-away, isolated, resource-limited processes.

Two entry points:

* :func:`run_tests` -- how code benchmarks are scored. The solution runs in one sandboxed
  process and serves calls of its ``entry_point``; the benchmark's tests run in another, with
  ``entry_point`` bound to a proxy. Arguments and results cross a pipe as plain data only
  (:mod:`.protocol`), and the verdict is the test side's report, read by the harness through a
  pipe the candidate never holds. So the candidate can neither decide a comparison (an object
  whose ``__eq__`` is always ``True`` never reaches the tests) nor forge the report.
* :func:`run_python` -- one program; passes iff it runs to its end (a per-run token echoed after
  ``exec`` returned, so an early ``exit(0)`` never passes). Code in the same process could read
  the token, so it is not used to score solutions.

Layers, outermost first (:mod:`.probe` says which apply on this machine):

1. **bubblewrap** (default; Debian package ``bubblewrap``): new user, PID, network, mount, IPC,
   UTS and cgroup namespaces, every capability dropped, ``--die-with-parent``, ``--new-session``;
   an empty tmpfs root with ``/usr`` and the interpreter's prefix read-only, and size-limited tmpfs
   on ``/tmp`` (``tmp_mb``) and the working folder ``/sandbox`` (``workdir_mb``). Where it is
   missing, :func:`run_python`/:func:`run_tests` refuse (:class:`SandboxUnavailable`) unless
   ``unsafe_exec=True`` (``--unsafe-exec``): then *process mode* keeps the layers below, only as
   root (two uids or no run: :func:`.probe.process_interpreter`), with the same two tmpfs in a
   mount namespace of its own where the kernel allows one.
2. **A uid per process** (:mod:`.limits`): as root, each sandboxed process runs under a leased
   unprivileged uid of its own, so ``RLIMIT_NPROC`` is its own whatever runs beside it, the
   candidate cannot open the test side's ``/proc/<pid>/fd``, and everything still running under
   the uid is killed when the run ends.
3. **Process lifetime** (:mod:`.process`): a new session; on completion or timeout the whole
   process group gets ``SIGKILL`` while the leader is still un-reaped.
4. **Resource limits**, set by the trusted runner (``inside.py``) before any untrusted byte runs:
   ``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE`` (caps files and captured output),
   ``RLIMIT_CORE = 0``, ``RLIMIT_NPROC``; process mode as root also drops to the leased uid and
   enters an empty network namespace where the kernel allows it.
5. **Reliability guard** (defence in depth, bypassable): ``os.fork``/``system``/``exec*``/``kill``,
   destructive file operations, ``subprocess``, ``socket`` raise ``PermissionError``; ``ctypes``,
   ``multiprocessing`` and friends are un-importable.

stdin is ``/dev/null`` once the runner has read its config from it (nothing of the config is on
the command line), the environment minimal (``PATH``, ``LANG``, ``LC_ALL``, ``HOME``, ``TMPDIR``),
stdout/stderr go to capped in-memory files opened before the start, whose tails the harness reads
through its own descriptors (:mod:`.process`): nothing is reopened by a path the code could
change. Linux only (``/proc``, process groups, pidfds, ``memfd_create``).
"""

from .probe import SandboxInfo, SandboxUnavailable, check_isolation, sandbox_info
from .runner import SandboxResult, run_python, run_tests

__all__ = ["SandboxInfo", "SandboxResult", "SandboxUnavailable", "check_isolation", "run_python", "run_tests",
           "sandbox_info"]
