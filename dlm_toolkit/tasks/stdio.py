"""Judge-style grading programs for :func:`~dlm_toolkit.tasks.sandbox.run_tests`: stdin/stdout
problems (AtCoder, Codeforces) and call-based ones (LeetCode ``Solution().method(*args)``).

Shared helper (LiveCodeBench uses it; any benchmark graded by feeding stdin and reading stdout can).
Each builder returns two programs for the sandbox's two sides:

* the **candidate side** (:func:`stdio_candidate`, :func:`call_candidate`) holds the model's code and
  serves one entry point per test: ``run_stdio(stdin_text, max_output)`` runs the code as
  ``__main__`` afresh with ``sys.stdin`` reading the text (``input()``, ``sys.stdin.buffer``,
  ``open(0)``) and returns ``[status, stdout]``; ``run_call(None)`` loads the solution and
  ``run_call(args)`` calls the method, returning ``[status, value]``. ``status`` is ``"ok"``,
  ``"flood"`` (more than ``max_output`` characters written: :data:`MAX_OUTPUT_CHARS`, the same for
  every test, so it tells nothing of the expected output) or ``"error <exception>"``.
  ``SystemExit``/``exit()`` ends a stdin program normally, as under a judge. stderr is discarded.
  No timer runs in this process: there is nothing for the code to catch.
* the **test side** (:func:`stdio_tests`, :func:`call_tests`) holds the expected outputs (plain
  JSON literals) and decides: a test passes iff the reply is ``ok`` and the output matches. Time
  is :func:`~.sandbox.run_tests`' ``call_timeout_s`` = :func:`call_limit` (the per-test timeout +
  :data:`SLACK_S` for the transfer), measured on the test side's clock from before the request
  is sent: a call not answered by then fails the run whatever it would have printed, and the
  candidate is killed. The first failing test fails the problem, as in LiveCodeBench's grader.

Comparison rules are LiveCodeBench's (``lcb_runner/evaluation/testing_util.py``):
:func:`lines_match` for stdout (both sides stripped, split on newlines, each line stripped; equal
line counts; each line equal as text, or else as whitespace-separated ``Decimal`` numbers, so
``1.0`` matches ``1`` but ``0.3333`` does not match ``0.33333``); call-based: ``==`` on the
returned value, a top-level tuple compared as a list.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Sequence

__all__ = ["MAX_OUTPUT_CHARS", "PREAMBLE", "SLACK_S", "call_candidate", "call_limit", "call_tests", "lines_match",
           "run_timeout", "stdio_candidate", "stdio_tests"]

SLACK_S = 1.0
"""Seconds a test may take beyond its timeout on the test side's clock (argument/result transfer)."""

MAX_OUTPUT_CHARS = 16 << 20
"""What a stdin program may print in one test on the candidate's side: one constant, the most that
crosses the sandbox boundary. The flood rule (twice the expected output + 64 Ki characters) is
applied by the test side: a cap computed from the expected output and handed to the candidate told
it that output's length (``sys.stdout.left``), enough to answer every Yes/No problem unseen."""

PREAMBLE = "\n".join(
    [f"from {m} import *" for m in ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math",
                                     "random", "statistics", "itertools", "functools", "operator", "io", "sys",
                                     "json", "builtins", "typing")]
    + ["import string, re, datetime, collections, heapq, bisect, copy, math, random, statistics, itertools, "
       "functools, operator, io, sys, json", "sys.setrecursionlimit(50000)"]) + "\n"
"""What LiveCodeBench's grader runs before every solution: the standard modules a competitive
programmer leaves unimported (``List``, ``defaultdict``, ``sqrt``, ... are in scope)."""


def lines_match(got: str, expected: str) -> bool:
    """LiveCodeBench's stdout comparison (see the module docstring). Self-contained: its source
    also runs alone on the test side."""
    from decimal import Decimal as _D

    def lines(text):
        return [line.strip() for line in text.strip().split("\n")]

    def numbers(line):
        try:
            return [_D(word) for word in line.split()]
        except Exception:
            return None

    a, b = lines(got), lines(expected)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        nx, ny = numbers(x), numbers(y)
        if nx is None or ny is None or nx != ny:
            return False
    return True

_RUNTIME = r'''
import builtins as _b, io as _io, sys as _sys

_SOURCE = __SOURCE__
_PREAMBLE = __PREAMBLE__
_CODE = compile(_SOURCE, "<solution>", "exec")
exec(_PREAMBLE, {"__builtins__": _b})  # imports its modules now: no test's time pays for them


class _Flood(BaseException):
    pass


class _Sink(_io.TextIOBase):
    def writable(self):
        return True

    def write(self, s):
        return len(s)


class _BytesOut:
    def __init__(self, text):
        self._text = text

    def write(self, b):
        self._text.write(bytes(b).decode("utf-8", "replace"))
        return len(b)

    def flush(self):
        pass


class _Out(_io.TextIOBase):
    def __init__(self, limit):
        self.parts, self.left, self.buffer = [], limit, _BytesOut(self)

    def writable(self):
        return True

    def write(self, s):
        if type(s) is not str:
            raise TypeError("write() argument must be str, not " + type(s).__name__)
        self.left -= len(s)
        if self.left < 0:
            raise _Flood()
        self.parts.append(s)
        return len(s)

    def flush(self):
        pass


def _exit(*args):
    raise SystemExit(*args)


def _run(work, stdin, out):
    # no timer here: the test side times each call from outside this process (run_tests' call_timeout_s)
    saved = _sys.stdin, _sys.stdout, _sys.stderr
    _sys.stdin, _sys.stdout, _sys.stderr = stdin, out, _Sink()
    status = "ok"
    try:
        work()
    except _Flood:
        status = "flood"
    except BaseException as exc:
        try:
            status = "error " + type(exc).__name__ + ": " + str(exc)[:200]
        except BaseException:
            status = "error"
    finally:
        _sys.stdin, _sys.stdout, _sys.stderr = saved
    return status
'''

_STDIO = r'''

def run_stdio(stdin_text, max_output):
    stdin = _io.TextIOWrapper(_io.BytesIO(stdin_text.encode("utf-8")), encoding="utf-8")
    out = _Out(max_output)

    def _open(file, mode="r", *args, **kwargs):
        if file == 0 or file == "/dev/stdin":
            return stdin.buffer if "b" in mode else stdin
        return _b.open(file, mode, *args, **kwargs)

    def work():
        ns = {"__name__": "__main__", "__builtins__": _b}
        exec(_PREAMBLE, ns)  # its `from sys import *` runs with the streams swapped: stdin/stdout are the test's
        ns.update(open=_open, exit=_exit, quit=_exit)
        try:
            exec(_CODE, ns)
        except SystemExit:
            pass

    status = _run(work, stdin, out)
    return [status, "".join(out.parts) if status == "ok" else ""]
'''

_CALL = r'''
_TARGET = []


def _load():
    ns = {"__name__": "__main__", "__builtins__": _b}
    exec(_PREAMBLE, ns)
    exec(_CODE, ns)
    target = ns["Solution"]() if "class Solution" in _SOURCE else None
    _TARGET.append(getattr(target, __NAME__) if target is not None else ns[__NAME__])


def run_call(args):
    # the first call (args None) loads the solution: timed from outside as every test is
    if args is None:
        status = _run(_load, _io.StringIO(""), _Sink())
        return [status, None] if status == "ok" else [status + " (while loading the solution)"]
    result = []

    def work():
        result.append(_TARGET[0](*args))

    status = _run(work, _io.StringIO(""), _Sink())
    return [status, result[0]] if status == "ok" else [status]
'''


def _runtime(code: str) -> str:
    return _RUNTIME.replace("__SOURCE__", repr(code)).replace("__PREAMBLE__", repr(PREAMBLE))


def stdio_candidate(code: str) -> str:
    """The candidate side of a stdin/stdout problem: serves ``run_stdio`` (a syntax error in
    ``code`` fails the load, so every test)."""
    return _runtime(code) + _STDIO


def call_candidate(code: str, func_name: str) -> str:
    """The candidate side of a call-based problem: ``run_call(None)`` runs ``code`` once (a call
    timed as a test, as LiveCodeBench's grader loads it within the timeout), then ``run_call(args)``
    calls ``Solution().<func_name>`` (or the function ``func_name`` when ``code`` defines no
    ``Solution`` class, as that grader does)."""
    if not func_name.isidentifier():
        raise ValueError(f"func_name: {func_name!r} is not a Python identifier")
    return _runtime(code) + _CALL.replace("__NAME__", repr(func_name))


def _literal(data: Any) -> str:
    return f"_dlm_json.loads({json.dumps(json.dumps(data))})"


_CHECK_REPLY = '''
    assert type(_dlm_reply) is list and _dlm_reply and type(_dlm_reply[0]) is str, f"test {_dlm_i}: a reply out of shape"
    assert _dlm_reply[0] == "ok" and len(_dlm_reply) == 2, f"test {_dlm_i}: {_dlm_reply[0][:300]}"
'''


def call_limit(timeout_s: float) -> float:
    """Seconds one test (one call across the sandbox) may take on the test side's clock: the
    per-test timeout plus :data:`SLACK_S` for the transfer (``run_tests``' ``call_timeout_s``)."""
    return float(timeout_s) + SLACK_S


def run_timeout(timeout_s: float, n_tests: int) -> float:
    """The whole run's wall-clock limit: LiveCodeBench's global one, ``(timeout + 1) * tests + 5``
    (the per-call limit ends a slow test long before it; a call-based load counts as one test)."""
    return (timeout_s + 1.0) * n_tests + 5.0


def stdio_tests(cases: Sequence[tuple[str, str]]) -> str:
    """The test side of a stdin/stdout problem: ``(stdin, expected stdout)`` pairs, in order."""
    head = ["import json as _dlm_json", inspect.getsource(lines_match),
            f"_DLM_CASES = {_literal([list(c) for c in cases])}",
            "for _dlm_i, (_dlm_in, _dlm_exp) in enumerate(_DLM_CASES):",
            f"    _dlm_reply = run_stdio(_dlm_in, {MAX_OUTPUT_CHARS})"]
    tail = ['    assert type(_dlm_reply[1]) is str, f"test {_dlm_i}: a reply out of shape"',
            '    assert len(_dlm_reply[1]) <= 2 * len(_dlm_exp) + 65536, f"test {_dlm_i}: flood"',
            '    assert lines_match(_dlm_reply[1], _dlm_exp), f"test {_dlm_i}: wrong answer"']
    return "\n".join(head) + _CHECK_REPLY + "\n".join(tail) + "\n"


def call_tests(cases: Sequence[tuple[list[Any], Any]]) -> str:
    """The test side of a call-based problem: the load (``run_call(None)``), then ``(argument list,
    expected value)`` pairs, in order."""
    head = ["import json as _dlm_json",
            f"_DLM_CASES = {_literal([[list(a), e] for a, e in cases])}",
            "_dlm_i, _dlm_reply = 'load', run_call(None)",
            _CHECK_REPLY.replace("\n    ", "\n").strip(),
            "for _dlm_i, (_dlm_args, _dlm_exp) in enumerate(_DLM_CASES):",
            "    _dlm_reply = run_call(_dlm_args)"]
    tail = ["    _dlm_got = list(_dlm_reply[1]) if type(_dlm_reply[1]) is tuple else _dlm_reply[1]",
            '    assert _dlm_got == _dlm_exp, f"test {_dlm_i}: wrong answer"']
    return "\n".join(head) + _CHECK_REPLY + "\n".join(tail) + "\n"
