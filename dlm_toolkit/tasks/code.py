"""The one verdict of every code benchmark here (MBPP, HumanEval+, MBPP+): :func:`check_solution`.

Contract: ``solution`` is the complete program that defines ``entry_point`` (HumanEval style:
prompt + completion; MBPP: the completion); ``tests`` is self-contained test code that touches the
candidate only by calling the function named ``entry_point``, with arguments and return values that
are plain data (MBPP's asserts call it by name; HumanEval-style ``check(candidate)`` ends with
``check(<entry_point>)``). That contract lets the sandbox run the candidate and the tests in two
sandboxed processes talking through a pipe (:func:`dlm_toolkit.tasks.sandbox.run_tests`): values
cross as plain data only and the verdict comes from the test side, so a wrong solution cannot
decide a comparison (an object whose ``__eq__`` is always true) or forge the result.

Also here: the limits every code task takes as options (:class:`CodeLimits`, checked by
:func:`code_limits` when the task is built), extracting the program from a model's answer
(:func:`extract_code`) and writing EvalPlus-style output-comparison tests as literals
(:func:`output_tests`).
"""

from __future__ import annotations

import base64
import json
import re
import sys
import zlib
from functools import lru_cache
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.runtime import host_memory_bytes

from .safe_pickle import MAX_BLOB_BYTES
from .sandbox import SandboxResult, run_python, run_tests

__all__ = ["CodeLimits", "check_solution", "code_limits", "extract_code", "memory_ceiling_mb", "output_tests",
           "run_outputs"]

MAX_TIMEOUT_S = 3600.0
"""The longest time limit of one run (BigCodeBench's official 240 s is the longest any benchmark sets)."""
MIN_MEMORY_MB = 64
"""The smallest memory limit: below it the interpreter itself does not start."""
MAX_TEST_MB = MAX_BLOB_BYTES >> 20


@lru_cache(maxsize=1)
def memory_ceiling_mb() -> int:
    """The most memory one code run may ask for: half of this machine's memory (the physical
    memory, or the memory limit of the cgroup this process runs in where that is lower), in MiB;
    a run limited to that cannot take the evaluator's host down with it."""
    return max(MIN_MEMORY_MB, host_memory_bytes() // 2 >> 20)


_RANGES = {
    "timeout_s": f"a number > 0 and <= {MAX_TIMEOUT_S:g} (seconds)",
    "memory_mb": "an integer in [{lo}, {hi}] (MiB; at most half of this machine's memory)",
    "max_test_mb": f"a number > 0 and <= {MAX_TEST_MB} (MiB)",
}


class CodeLimits(BaseModel):
    """The limits of a code task's sandboxed runs, as its options give them: exact types (``true``
    is not 1 second, ``"512"`` is not 512 MiB), finite, within range. ``memory_mb`` is bounded by
    :func:`memory_ceiling_mb` (passed as the validation context ``ceiling``)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    timeout_s: float = Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    memory_mb: int = Field(ge=MIN_MEMORY_MB)
    max_test_mb: float | None = Field(None, gt=0, le=MAX_TEST_MB, allow_inf_nan=False)

    @field_validator("memory_mb")
    @classmethod
    def _within_machine(cls, v: int, info: ValidationInfo) -> int:
        ceiling = (info.context or {}).get("ceiling", memory_ceiling_mb())
        if v > ceiling:
            raise ValueError("above the ceiling")
        return v


def code_limits(task: str, *, timeout_s: Any, memory_mb: Any, default_memory_mb: int | None = None,
                max_test_mb: Any = None) -> CodeLimits:
    """``task``'s limit options checked (:class:`CodeLimits`), before any data is read or decoded.

    ``memory_mb=None`` takes ``default_memory_mb`` (the benchmark's official value), lowered to
    :func:`memory_ceiling_mb` where this machine has less, with one line on stderr saying so.

    Raises:
        ConfigError: one line naming the first bad option, its allowed range and the value given.
    """
    ceiling = memory_ceiling_mb()
    lowered = memory_mb is None and default_memory_mb is not None and default_memory_mb > ceiling
    if memory_mb is None and default_memory_mb is not None:
        memory_mb = min(default_memory_mb, ceiling)
    values = {"timeout_s": timeout_s, "memory_mb": memory_mb, "max_test_mb": max_test_mb}
    try:
        limits = CodeLimits.model_validate(values, context={"ceiling": ceiling})
    except ValidationError as err:
        option = str(err.errors()[0]["loc"][0])
        allowed = _RANGES[option].format(lo=MIN_MEMORY_MB, hi=ceiling)
        raise ConfigError(f"task '{task}': {option}: must be {allowed} (got {_short(values[option])})") from None
    if lowered:
        print(f"{task}: memory_mb {memory_mb} (the default {default_memory_mb} lowered to half of this machine's "
              "memory; pass --task-arg memory_mb=N to choose)", file=sys.stderr)
    return limits


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_solution(solution: str, tests: str, entry_point: str, *, timeout_s: float, memory_mb: int,
                   unsafe_exec: bool) -> SandboxResult:
    """Run ``tests`` against ``solution`` in the sandbox; ``passed`` is the verdict.

    Args:
        solution: the complete candidate program (defines ``entry_point``).
        tests: test code calling only ``entry_point``, with plain-data arguments and results.
        entry_point: the function's name.
        timeout_s / memory_mb: limits of the run.
        unsafe_exec: allow running without bubblewrap where it is missing (process limits only).
    """
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point: {entry_point!r} is not a Python identifier")
    return run_tests(solution, tests, entry_point, timeout_s=timeout_s, memory_mb=memory_mb, unsafe_exec=unsafe_exec)


_FENCE = re.compile(r"```[ \t]*(?:python|py|Python3?|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str) -> str:
    """The program in a model's answer: the first fenced code block (```python ... ```, an
    unclosed fence runs to the end) when there is one, else the text as is."""
    m = _FENCE.search(completion)
    return m.group(1) if m else completion


# Comparison used by the generated tests: exact, or (EvalPlus) within atol/rtol where the expected
# value is a float or a list/tuple of floats (atol 1e-6 when the benchmark gives 0).
_COMPARE = '''
def _dlm_close(out, exp, atol):
    def floats(x):
        return isinstance(x, float) or (isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(i, float) for i in x))
    if out == exp:
        return True
    if not floats(exp):
        return False
    atol = atol or 1e-6
    if type(out) is not type(exp):
        return False
    pairs = [(out, exp)] if isinstance(exp, float) else (list(zip(out, exp)) if len(out) == len(exp) else None)
    if pairs is None:
        return False
    return all(isinstance(o, (int, float)) and abs(o - e) <= atol + 1e-07 * abs(e) for o, e in pairs)
'''


def output_tests(entry_point: str, inputs: Sequence[Sequence[Any]], expected: Sequence[str], atol: float) -> str:
    """Test code comparing ``entry_point(*args)`` with each expected output.

    ``inputs`` are argument lists of plain data (carried as a JSON literal and loaded as the
    reference run loaded them, see :func:`run_outputs`); ``expected`` the ``repr`` of each
    reference output, written as Python literals. Each case is compared with ``_dlm_close``
    (exact, or within ``atol`` for floats, as EvalPlus does).
    """
    if len(inputs) != len(expected):
        raise ValueError(f"{len(inputs)} inputs but {len(expected)} expected outputs")
    lines = [_COMPARE, "import json as _dlm_json", "inf, nan = float('inf'), float('nan')",
             f"_dlm_atol = {float(atol)!r}",
             f"_dlm_inputs = _dlm_json.loads({json.dumps(json.dumps([list(a) for a in inputs]))})",
             "_dlm_expected = ["]
    lines += [f"    {exp}," for exp in expected]
    lines += ["]",
              "for _dlm_i, (_dlm_args, _dlm_exp) in enumerate(zip(_dlm_inputs, _dlm_expected)):",
              f"    _dlm_out = {entry_point}(*_dlm_args)",
              "    assert _dlm_close(_dlm_out, _dlm_exp, _dlm_atol), f'case {_dlm_i}: got {_dlm_out!r}'"]
    return "\n".join(lines) + "\n"


_MARK = "@@dlm-outputs@@"
_TAIL_BUDGET = 3500  # the sandbox returns the last ~4000 characters of stdout: stay below


def run_outputs(solution: str, entry_point: str, inputs: Sequence[Sequence[Any]], *, timeout_s: float,
                memory_mb: int, unsafe_exec: bool) -> list[str]:
    """The ``repr`` of ``entry_point(*args)`` for each argument list, computed by running the
    (reference) ``solution`` in the sandbox: all inputs in one run when the (compressed) outputs
    fit the sandbox's stdout tail, else halves of them, recursively.

    Raises:
        RuntimeError: the reference solution failed on an input (raised or timed out).
    """
    if not inputs:
        return []
    payload = json.dumps(json.dumps([list(a) for a in inputs]))
    program = (solution + "\n\nimport json as _dlm_json, zlib as _dlm_zlib, base64 as _dlm_b64\n"
               f"_dlm_in = _dlm_json.loads({payload})\n"
               f"_dlm_out = _dlm_json.dumps([repr({entry_point}(*a)) for a in _dlm_in]).encode()\n"
               f"print({_MARK!r} + _dlm_b64.b64encode(_dlm_zlib.compress(_dlm_out, 9)).decode())\n")
    result = run_python(program, timeout_s=timeout_s, memory_mb=memory_mb, unsafe_exec=unsafe_exec)
    if not result.passed:
        raise RuntimeError(f"the reference solution of {entry_point} failed: {result.stderr_tail[-500:]}")
    line = next((ln for ln in result.stdout_tail.splitlines() if ln.startswith(_MARK)), None)
    if line is not None and len(line) < _TAIL_BUDGET:
        return json.loads(zlib.decompress(base64.b64decode(line[len(_MARK):])))
    if len(inputs) == 1:
        raise RuntimeError(f"the reference output of {entry_point} on one input is too large to carry back")
    half = len(inputs) // 2
    kwargs = dict(timeout_s=timeout_s, memory_mb=memory_mb, unsafe_exec=unsafe_exec)
    return run_outputs(solution, entry_point, inputs[:half], **kwargs) + \
        run_outputs(solution, entry_point, inputs[half:], **kwargs)
