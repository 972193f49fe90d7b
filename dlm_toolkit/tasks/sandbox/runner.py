"""The two entry points: :func:`run_python` (one program) and :func:`run_tests` (a solution and its
tests on two sides of a plain-data boundary). Both return a :class:`SandboxResult`."""

from __future__ import annotations

import json
import keyword
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass

from .probe import (SandboxInfo, SandboxUnavailable, check_isolation, no_bwrap_message, process_interpreter,
                    sandbox_info)
from .process import SandboxProcess, read_available

REPORT_LIMIT = 1 << 16


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of :func:`run_python` or :func:`run_tests`.

    Attributes:
        passed: :func:`run_python`: the code ran to its end without an exception, in time.
            :func:`run_tests`: the tests ran to their end without an exception, in time, and every
            value the candidate returned was plain data (decided from the test side's report only).
        returncode: the exit status of the program (run_tests: of the test side); negative: killed
            by that signal.
        timed_out: the wall-clock limit was hit and everything was killed.
        stderr_tail: the last ~4000 characters of stderr (run_tests: the test side's, where a
            failing assertion's traceback is).
        stdout_tail: the last ~4000 characters of stdout.
        duration_s: wall-clock seconds from start to reaping.
        reason: run_tests: why the run failed, as the test side saw it ('' when it passed).
        candidate_stdout_tail: run_tests: what the solution printed.
        candidate_stderr_tail: run_tests: the candidate side's stderr (a solution that fails to load).
        python: the interpreter the code ran under (bubblewrap's, or process mode's, which may be
            ``/usr/bin/python3`` rather than the evaluator's: :func:`sandbox_python`).
    """

    passed: bool
    returncode: int | None
    timed_out: bool
    stderr_tail: str
    stdout_tail: str = ""
    duration_s: float = 0.0
    reason: str = ""
    candidate_stdout_tail: str = ""
    candidate_stderr_tail: str = ""
    python: str = ""


def sandbox_python(isolation: str, python: str | None = None) -> str:
    """The interpreter sandboxed code runs under ``isolation`` (``"bwrap"`` or ``"process"``) when
    ``python`` (default: the evaluator's own) is asked for: it differs where the sandbox's users
    cannot read that one (a pyenv under ``/root``) and ``/usr/bin/python3`` stands in, with only
    the libraries installed for it."""
    if isolation == "bwrap":
        return sandbox_info(python or sys.executable).bwrap_python or ""
    return process_interpreter(python).python


def _setup(timeout_s: float, memory_mb: int, python: str | None, unsafe_exec: bool,
           isolation: str | None, tmp_mb: int = 64, workdir_mb: int = 64) -> tuple[str, SandboxInfo, bool]:
    """Check the limits; ``(interpreter, its SandboxInfo, under bubblewrap?)``."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if memory_mb <= 0:
        raise ValueError(f"memory_mb must be > 0, got {memory_mb}")
    for name, value in (("tmp_mb", tmp_mb), ("workdir_mb", workdir_mb)):
        if type(value) is not int or value <= 0:
            raise ValueError(f"{name} must be a positive integer (MiB), got {value!r}")
    exe = python or sys.executable
    info = sandbox_info(exe)
    boxed = _isolation(unsafe_exec, isolation, info)
    if not boxed:  # two unprivileged uids or no run
        info = process_interpreter(python)
        exe = info.python
    return exe, info, boxed


def _isolation(unsafe_exec: bool, isolation: str | None, info: SandboxInfo) -> bool:
    """True for bubblewrap, False for process mode (checked against what the caller accepted)."""
    isolation = isolation or check_isolation(unsafe_exec, info)
    if isolation not in ("bwrap", "process"):
        raise ValueError(f"isolation must be 'bwrap' or 'process', got {isolation!r}")
    if isolation == "process" and not unsafe_exec:
        raise SandboxUnavailable("isolation 'process' runs untrusted code without the OS sandbox; "
                                 "it needs unsafe_exec=True (--unsafe-exec)")
    if isolation == "bwrap" and info.bwrap is None:
        raise SandboxUnavailable(no_bwrap_message(info))
    return isolation == "bwrap"


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
    tmp_mb: int = 64,
    workdir_mb: int = 64,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a sandboxed ``python -I`` (see the package docstring).

    A run passes iff the harness's per-run token comes back through a pipe after ``exec(code)``
    returned *and* the process exited 0 in time: exiting early never passes. (Code that reads the
    token out of its own process could forge it: use :func:`run_tests` to score solutions.)

    Args:
        code: Python source; it passes if it runs to the end without raising.
        timeout_s: wall-clock limit; everything it started is killed when it is hit.
        memory_mb: address-space limit (``RLIMIT_AS``) per process.
        max_processes: ``RLIMIT_NPROC`` where it is enforceable (see :mod:`.limits`).
        output_limit_bytes: largest file (stdout/stderr included) the code may write.
        guard: install the reliability guard; ``False`` only to test the OS-level layers.
        python: interpreter to use without bubblewrap (default: ``sys.executable``).
        unsafe_exec: where bubblewrap cannot run, run with the process-level layers only
            instead of raising :class:`SandboxUnavailable`.
        isolation: ``"bwrap"`` or ``"process"`` (the latter needs ``unsafe_exec``); default:
            ``"bwrap"`` where it works, else ``"process"`` if ``unsafe_exec``.
        tmp_mb, workdir_mb: sizes of the tmpfs on ``/tmp`` and on the working folder (bubblewrap,
            and process mode where it has a mount namespace: :attr:`.SandboxInfo.mount_namespace`).

    Raises:
        SandboxUnavailable: bubblewrap is needed and cannot run here. Never raises for anything
            the code does.
    """
    exe, info, boxed = _setup(timeout_s, memory_mb, python, unsafe_exec, isolation, tmp_mb, workdir_mb)
    token_r, token_w = os.pipe()
    result_r, result_w = os.pipe()
    token = os.urandom(16).hex().encode()
    os.write(token_w, token)  # 32 bytes: fits any pipe buffer, never blocks
    os.close(token_w)
    try:
        start = time.monotonic()
        with SandboxProcess(mode="script", files={"code": code}, fds={"token_fd": token_r, "result_fd": result_w},
                            boxed=boxed, info=info, exe=exe, timeout_s=timeout_s, memory_mb=memory_mb,
                            max_processes=max_processes, output_limit_bytes=output_limit_bytes, guard=guard,
                            tmp_mb=tmp_mb, workdir_mb=workdir_mb) as box:
            os.close(token_r)
            os.close(result_w)
            token_r = result_w = -1
            timed_out = not box.wait(start + timeout_s)
            returncode = box.stop()
            duration = time.monotonic() - start
            stdout, stderr = box.tails()
        reported = read_available(result_r, len(token) + 1)
        return SandboxResult(passed=returncode == 0 and not timed_out and reported == token, returncode=returncode,
                             timed_out=timed_out, stderr_tail=stderr, stdout_tail=stdout, duration_s=duration,
                             python=_ran(info, exe, boxed))
    finally:
        for fd in (token_r, result_r, result_w):
            if fd >= 0:
                os.close(fd)


def run_tests(
    solution: str,
    tests: str,
    entry_point: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    unsafe_exec: bool = False,
    max_processes: int = 16,
    output_limit_bytes: int = 1 << 20,
    guard: bool = True,
    python: str | None = None,
    isolation: str | None = None,
    tmp_mb: int = 64,
    workdir_mb: int = 64,
    call_timeout_s: float | None = None,
) -> SandboxResult:
    """Run ``tests`` against the function ``entry_point`` that ``solution`` defines, across a
    plain-data boundary; the verdict comes from the test side only.

    Two sandboxed processes (each under its own leased uid, as root): the *candidate* executes
    ``solution`` and serves calls of ``entry_point``; the *test side* executes ``tests`` with
    ``entry_point`` bound to a proxy that sends the arguments and returns the decoded result
    (:mod:`.protocol`: ``None``/``bool``/``int``/``float``/``str``/``bytes`` and
    lists/tuples/dicts/sets of them, exact types only). The two cannot reach each other's
    memory: separate PID namespaces and uids under bubblewrap, separate uids in process mode as
    root. So a returned object with ``__eq__`` always ``True``, a patched ``int`` subclass, a
    generator or anything else that is not plain data fails the test instead of deciding it.

    An exception the candidate raises crosses as its nearest builtin class with its message
    (``class E(ValueError)`` arrives as ``ValueError``), so ``assert raises``-style tests work;
    ``SystemExit``/``KeyboardInterrupt``, a non-plain result, a broken frame or a dead candidate
    end the run as a failure even if the tests catch what the proxy raises.

    Args:
        solution: the complete program defining ``entry_point`` (``__name__`` is ``"solution"``,
            so ``if __name__ == "__main__":`` blocks do not run, as in the reference harnesses).
        tests: self-contained test code that touches the candidate only by calling
            ``entry_point`` (HumanEval: the prompt's helpers, the test, ``check(entry_point)``).
        entry_point: the function's name (a Python identifier).
        timeout_s: wall-clock limit of the whole run (both sides).
        memory_mb, max_processes, output_limit_bytes: per side, as in :func:`run_python`.
        guard: the reliability guard on the candidate side (the test side runs the benchmark's
            own code and only ever holds plain data, so it goes without).
        unsafe_exec, isolation, python, tmp_mb, workdir_mb: as in :func:`run_python` (per side).
        call_timeout_s: each call of ``entry_point`` must be answered within this many seconds of
            the test side's clock, transfer included, or the run fails ("time limit exceeded"):
            the candidate's time is measured outside its process, so it cannot catch or stop the
            timer (the candidate is killed when the run ends). ``None``: only ``timeout_s``.

    Returns:
        A :class:`SandboxResult`: ``passed`` iff the test side reported that the tests ran to
        their end and exited 0 in time; ``reason`` says why not.

    Raises:
        ValueError: ``entry_point`` is not an identifier, or a bad limit.
        SandboxUnavailable: as in :func:`run_python`.
    """
    if not (isinstance(entry_point, str) and entry_point.isidentifier() and not keyword.iskeyword(entry_point)):
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    if call_timeout_s is not None and not (type(call_timeout_s) in (int, float) and 0 < call_timeout_s < 1e9):
        raise ValueError(f"call_timeout_s must be a number of seconds in (0, 1e9), got {call_timeout_s!r}")
    exe, info, boxed = _setup(timeout_s, memory_mb, python, unsafe_exec, isolation, tmp_mb, workdir_mb)
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    report_r, report_w = os.pipe()
    ours = [requests_r, requests_w, replies_r, replies_w, report_w]
    common = dict(boxed=boxed, info=info, exe=exe, timeout_s=timeout_s, memory_mb=memory_mb,
                  max_processes=max_processes, output_limit_bytes=output_limit_bytes, guard=guard,
                  extra={"entry_point": entry_point}, tmp_mb=tmp_mb, workdir_mb=workdir_mb)
    try:
        start = time.monotonic()
        with ExitStack() as stack:
            candidate = stack.enter_context(SandboxProcess(
                mode="candidate", files={"solution": solution},
                fds={"requests_fd": requests_r, "replies_fd": replies_w}, **common))
            tester = stack.enter_context(SandboxProcess(  # the benchmark's own code: no guard to import (~50 ms)
                mode="tests", files={"tests": tests},
                fds={"requests_fd": requests_w, "replies_fd": replies_r, "report_fd": report_w},
                **{**common, "guard": False, "extra": {"entry_point": entry_point, "call_timeout_s": call_timeout_s}}))
            for fd in ours:  # only the two sides hold the channel now: a side that dies means EOF
                os.close(fd)
            ours = []
            finished = tester.wait(start + timeout_s)
            returncode = tester.stop()
            candidate.stop()
            duration = time.monotonic() - start
            stdout, stderr = tester.tails()
            cand_out, cand_err = candidate.tails()
        report = _parse_report(read_available(report_r, REPORT_LIMIT))
        passed = finished and returncode == 0 and report.get("passed") is True
        reason = "" if passed else (f"timed out after {timeout_s:g} s" if not finished else
                                    str(report.get("reason") or f"the test side exited with {returncode}"))
        return SandboxResult(passed=passed, returncode=returncode, timed_out=not finished, stderr_tail=stderr,
                             stdout_tail=stdout, duration_s=duration, reason=reason,
                             candidate_stdout_tail=cand_out, candidate_stderr_tail=cand_err,
                             python=_ran(info, exe, boxed))
    finally:
        for fd in [*ours, report_r]:
            os.close(fd)


def _ran(info: SandboxInfo, exe: str, boxed: bool) -> str:
    return (info.bwrap_python or "") if boxed else exe


def _parse_report(data: bytes) -> dict:
    try:
        report = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return report if isinstance(report, dict) else {}
