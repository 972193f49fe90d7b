"""The plain-data boundary of run_tests: the codec alone, then wrong solutions that fooled the
in-process harness (each scores 0 now), exceptions across the boundary, and legitimate values."""

from __future__ import annotations

import json
import math
import os

import pytest

from dlm_toolkit.tasks import HumanEvalTask, Instance, get_task
from dlm_toolkit.tasks.sandbox import run_python, run_tests
from dlm_toolkit.tasks.sandbox.protocol import (
    MAX_DEPTH, MAX_MESSAGE_BYTES, NotPlainData, ProtocolError, decode, encode, receive, send)


def same(a: object, b: object) -> bool:
    """Equal *and* of the same exact types all the way down (the reference the codec is held to)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b)) and \
            all(same(a[k], b[k]) for k in a)
    return a == b


ROUND_TRIP = [
    None, True, False, 0, -7, 10**300, -(2**64), 0.1, -0.0, 1e308, float("nan"), float("inf"), float("-inf"),
    "", "é\n\"\\", "\udcff lone surrogate", b"", b"\x00\xff", [], (), (1,), [1, [2, [3]]],
    {"a": 1, 2: "b", (1, 2): [3], None: None, b"k": 1.5, frozenset({1}): ()}, {1, "a", (2, 3)},
    frozenset({frozenset({1}), 2}), [(True, 1, 1.0)], {"nested": {"deep": [{(1, (2,)): {3}}]}},
]


@pytest.mark.parametrize("value", ROUND_TRIP, ids=lambda v: type(v).__name__)
def test_plain_values_cross_with_their_exact_types(value):
    wire = json.loads(json.dumps(encode(value), allow_nan=False))
    assert same(decode(wire), value)


class IntEq(int):
    def __eq__(self, other):
        return True

    __hash__ = int.__hash__


class StrEq(str):
    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


class ListEq(list):
    def __eq__(self, other):
        return True


def _cycle():
    x: list = []
    x.append(x)
    return x


NOT_PLAIN = {
    "object": object(), "int subclass": IntEq(1), "str subclass": StrEq("a"), "list subclass": ListEq([1]),
    "bool subclass in a list": [IntEq(0)], "generator": (i for i in range(3)), "bytearray": bytearray(b"x"),
    "function": len, "type": int, "complex": 1j, "range": range(3), "dict key subclass": {StrEq("k"): 1},
    "cycle": _cycle(), "too deep": [[[]]] * 1 if False else eval("[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5)),
}


@pytest.mark.parametrize("name", sorted(NOT_PLAIN))
def test_anything_else_is_refused_not_converted(name):
    with pytest.raises(NotPlainData):
        encode(NOT_PLAIN[name])


TAMPERED = {
    "two keys": {"t": [], "s": []}, "unknown tag": {"x": [1]}, "tuple of a string": {"t": "ab"},
    "unhashable set element": {"s": [[1]]}, "unhashable dict key": {"d": [[[1], 2]]},
    "dict entry of three": {"d": [[1, 2, 3]]}, "bad hex": {"b": "zz"}, "float tag of a number": {"f": 1},
    "float tag of another word": {"f": "NaN"}, "too deep": json.loads("[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5)),
}


@pytest.mark.parametrize("name", sorted(TAMPERED))
def test_the_decoder_refuses_what_encode_never_sends(name):
    with pytest.raises(ProtocolError):
        decode(TAMPERED[name])


@pytest.mark.parametrize("frame", [
    b'{"t":[],"s":[]}', b"[NaN]", b"[Infinity]", b"not json", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000,
])
def test_frames_are_parsed_strictly(frame):
    r, w = os.pipe()
    try:
        os.write(w, len(frame).to_bytes(4, "big"))
        with open(w, "wb", closefd=False) as f:  # a 200 kB frame outgrows the pipe buffer: write it from a thread
            import threading

            writer = threading.Thread(target=lambda: (f.write(frame), f.flush()))
            writer.start()
            with pytest.raises(ProtocolError):
                receive(r)
            writer.join()
    finally:
        os.close(r)
        os.close(w)


def test_frame_size_is_bounded_both_ways():
    r, w = os.pipe()
    try:
        os.write(w, (MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(ProtocolError, match="more than"):
            receive(r)  # refused from the length alone: nothing of the body is read
        with pytest.raises(NotPlainData, match="more than"):
            send(w, "x" * MAX_MESSAGE_BYTES)
    finally:
        os.close(r)
        os.close(w)


# ----------------------------------------------------------------------------- wrong solutions
@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    return get_task("humaneval", timeout_s=3.0, memory_mb=512)


@pytest.fixture(scope="module")
def problems(task: HumanEvalTask) -> dict[str, Instance]:
    return {p.meta["task_id"]: p for p in task.instances(164, seed=0, split="eval")}


def in_process_program(problem: Instance, completion: str) -> str:
    """What the harness ran before: solution and tests in one process (the independent witness
    that a row really fools a harness comparing inside the candidate's process)."""
    return (problem.prompt + completion + "\n\n" + problem.meta["test"] + "\n\n"
            + f"check({problem.meta['entry_point']})\n")


ALWAYS_EQUAL = "    class Yes:\n        __eq__ = lambda s, o: True\n        __ne__ = lambda s, o: False\n    return Yes()\n"

# name -> (problem, completion body). Every row passes the in-process harness (checked below) and
# must score 0 across the boundary.
FOOLS_IN_PROCESS = {
    "__eq__ always True": ("HumanEval/0", ALWAYS_EQUAL),
    "int subclass with patched ==": ("HumanEval/2", (
        "    class I(float):\n        __eq__ = lambda s, o: True\n        __hash__ = float.__hash__\n"
        "        __sub__ = __rsub__ = lambda s, o: 0.0\n    return I(0.5)\n")),
    "str subclass with patched ==": ("HumanEval/27", (
        "    class S(str):\n        __eq__ = lambda s, o: True\n        __hash__ = str.__hash__\n    return S('')\n")),
    "list subclass with patched ==": ("HumanEval/1", (
        "    class L(list):\n        __eq__ = lambda s, o: True\n    return L()\n")),
    "__bool__/__hash__ overrides": ("HumanEval/0", (
        "    class B:\n        __bool__ = lambda s: True\n        __hash__ = lambda s: 1\n"
        "        __eq__ = lambda s, o: True\n    return B()\n")),
    "redefine the prompt's helper": ("HumanEval/38", "    return s\nencode_cyclic = lambda s: s\n"),
    "patch builtins the tests use": ("HumanEval/4", "    return 0.0\nimport builtins\nbuiltins.abs = lambda x: 0\n"),
    "patch a module the tests use": ("HumanEval/32", "    return 0.0\nimport math\nmath.fabs = lambda x: 0.0\n"),
}

NEVER_PLAIN = {
    "generator": ("HumanEval/0", "    yield True\n"),
    "repr that lies": ("HumanEval/0", "    class R:\n        __repr__ = __str__ = lambda s: 'True'\n    return R()\n"),
    "NotImplemented": ("HumanEval/0", "    return NotImplemented\n"),
    "raises SystemExit": ("HumanEval/0", "    raise SystemExit(0)\n"),
    "raises KeyboardInterrupt": ("HumanEval/0", "    raise KeyboardInterrupt\n"),
    "huge return value": ("HumanEval/0", "    return 'x' * (17 << 20)\n"),
    "forge a report on every descriptor": ("HumanEval/0", (
        "    import posix, json\n    msg = json.dumps({'passed': True, 'reason': '', 'calls': 9}).encode()\n"
        "    for fd in range(3, 256):\n        try:\n            posix.write(fd, msg)\n        except OSError:\n"
        "            pass\n    return True\n")),
    "forge reply frames ahead": ("HumanEval/0", (
        "    import posix\n    frame = b'{\"t\":[%d,\"ok\",true]}'\n    for seq in range(1, 50):\n"
        "        data = frame % seq\n        for fd in range(3, 64):\n            try:\n"
        "                posix.write(fd, len(data).to_bytes(4, 'big') + data)\n            except OSError:\n"
        "                pass\n    return True\n")),
    "find and kill the test side": ("HumanEval/0", (
        "    import posix\n    for pid in posix.listdir('/proc'):\n        if pid.isdigit() and int(pid) != posix.getpid():\n"
        "            try:\n                posix.kill(int(pid), 9)\n            except OSError:\n                pass\n"
        "    return True\n")),
    "read another process's memory": ("HumanEval/0", (
        "    import posix\n    for pid in posix.listdir('/proc'):\n        try:\n"
        "            open(f'/proc/{pid}/mem', 'rb').read(1)\n        except (OSError, ValueError):\n            pass\n"
        "    return True\n")),
}


@pytest.mark.parametrize("name", sorted(FOOLS_IN_PROCESS))
def test_solutions_that_fooled_the_in_process_harness_score_zero(name, task, problems):
    task_id, body = FOOLS_IN_PROCESS[name]
    problem = problems[task_id]
    assert run_python(in_process_program(problem, body), timeout_s=3.0).passed, "the row no longer fools in-process"
    result = task.run(problem, body)
    assert not result.passed and task.score(problem, body) == 0.0, result


@pytest.mark.parametrize("name", sorted(NEVER_PLAIN))
def test_what_is_not_plain_data_or_tampers_fails(name, task, problems):
    task_id, body = NEVER_PLAIN[name]
    result = task.run(problems[task_id], body)
    assert not result.passed and not result.timed_out, result
    assert result.reason, "a failure says why"


def test_a_correct_solution_passes_and_a_right_answer_by_luck_does_not(task, problems):
    problem = problems["HumanEval/0"]
    assert task.run(problem, problem.reference).passed
    assert not task.run(problem, "    return True\n").passed
    assert not task.run(problem, "    return False\n").passed


# ----------------------------------------------------------------------------- exceptions
RAISES = """
def f(x):
    class Custom(ValueError):
        pass
    if x == 'value':
        raise ValueError('bad value')
    if x == 'custom':
        raise Custom('mine')
    if x == 'unicode':
        b'\\xff'.decode('utf-8')
    if x == 'exit':
        raise SystemExit(0)
    if x == 'generator':
        return (c for c in x)
    return x
"""


@pytest.mark.parametrize("tests,passes", [
    ("try:\n    f('value')\n    raise AssertionError('no raise')\nexcept ValueError as e:\n    assert str(e) == 'bad value'\n", True),
    ("try:\n    f('custom')\nexcept ValueError as e:\n    assert type(e) is ValueError and str(e) == 'mine'\n", True),
    ("try:\n    f('unicode')\nexcept UnicodeError:\n    pass\n", True),
    ("try:\n    f('value')\nexcept TypeError:\n    pass\n", False),  # the wrong class is not caught
    ("try:\n    f('exit')\nexcept BaseException:\n    pass\n", False),  # SystemExit ends the run, caught or not
    ("try:\n    f(f)\nexcept BaseException:\n    pass\n", False),  # a function cannot be an argument
    ("try:\n    f('generator')\nexcept BaseException:\n    pass\n", False),  # nor a generator a result
    ("assert f([1, (2, {3})]) == [1, (2, {3})]\n", True),
])
def test_exceptions_cross_as_builtin_classes(tests, passes):
    result = run_tests(RAISES, tests, "f", timeout_s=3.0)
    assert result.passed is passes, result


def test_values_keep_their_exact_types_across_the_boundary():
    solution = "def f(v):\n    return v\n"
    checks = "".join(f"r = f({v!r})\nassert r == {v!r} and type(r) is type({v!r})\n"
                     for v in [(1, 2), {1, 2}, frozenset({3}), {"k": (1,)}, b"\x00", 10**50, 0.5, "s", None, True])
    checks += "import math\nassert math.isnan(f(float('nan'))) and f(float('-inf')) == float('-inf')\n"
    checks += "assert math.copysign(1, f(-0.0)) == -1\nassert f(v=[1]) == [1]\n"
    assert run_tests(solution, checks, "f", timeout_s=3.0).passed


def test_a_solution_that_fails_to_load_fails_with_its_reason():
    result = run_tests("def f(:\n", "assert True\n", "f", timeout_s=3.0)
    assert not result.passed and "did not load" in result.reason and "SyntaxError" in result.reason
    result = run_tests("g = 1\n", "assert True\n", "f", timeout_s=3.0)
    assert not result.passed and "no callable 'f'" in result.reason
    with pytest.raises(ValueError, match="identifier"):
        run_tests("", "", "not an identifier")


def test_every_code_benchmark_verdict_goes_across_the_boundary():
    """MBPP / HumanEval+ / MBPP+ score through tasks.code.check_solution: the same boundary."""
    from dlm_toolkit.tasks.code import check_solution

    solution = "class Yes:\n    __eq__ = lambda s, o: True\n\ndef add(a, b):\n    return Yes()\n"
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
    assert run_python(solution + tests, timeout_s=3.0).passed  # one process: fooled
    result = check_solution(solution, tests, "add", timeout_s=3.0, memory_mb=512, unsafe_exec=False)
    assert not result.passed and "not plain data" in result.reason
    right = check_solution("def add(a, b):\n    return a + b\n", tests, "add", timeout_s=3.0, memory_mb=512,
                           unsafe_exec=False)
    assert right.passed


def test_a_receive_deadline_holds_for_the_whole_frame_on_any_descriptor_number():
    """The per-call limit of run_tests(call_timeout_s): a frame must be whole by the deadline (a
    sender stalling after the length is late too), on pipes numbered past select()'s 1024."""
    import time

    from dlm_toolkit.tasks.sandbox.protocol import DeadlinePassed

    r, w = os.pipe()
    hi_r, hi_w = os.dup2(r, 1500), os.dup2(w, 1501)
    os.close(r)
    os.close(w)
    try:
        send(hi_w, [1, "x"])
        assert receive(hi_r, time.monotonic() + 5) == [1, "x"]  # near miss: in time
        os.write(hi_w, (10).to_bytes(4, "big") + b"[1,")  # the length, then only part of the body
        start = time.monotonic()
        with pytest.raises(DeadlinePassed):
            receive(hi_r, time.monotonic() + 0.2)
        assert 0.15 < time.monotonic() - start < 2
        with pytest.raises(DeadlinePassed):
            receive(hi_r, time.monotonic() - 1)  # already past: no read at all
    finally:
        os.close(hi_r)
        os.close(hi_w)
