"""LiveCodeBench's untrusted paths: hostile blobs and records refused in time linear in their bytes
(each next to a near miss accepted at its bound), every test timed from outside the candidate,
exact comparisons, libraries the sandbox lacks counted as env_missing, and the deliberate departures
from the official grader."""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import time
import tracemalloc
import zlib
from pathlib import Path

import pytest

from dlm_toolkit.tasks import get_task
from dlm_toolkit.tasks.data import DataError
from dlm_toolkit.tasks.livecodebench import MAX_ARGS, MAX_TESTS
from dlm_toolkit.tasks.safe_pickle import MAX_CONTAINERS, MAX_DEPTH, MAX_OPCODES, UnsafeBlob, decode_blob, load_plain
from dlm_toolkit.tasks.sandbox import check_isolation, run_tests
from dlm_toolkit.tasks.sandbox.runner import sandbox_python
from dlm_toolkit.tasks.stdio import lines_match

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "livecodebench"
GUARD_S = 5.0  # a wall-clock guard only: each refusal is checked by its message; the hostile inputs took minutes


def blob(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data)).decode()


def packed(tests: list[dict]) -> str:
    return blob(pickle.dumps(json.dumps(tests)))


def stdin_test(i: str, o: str) -> dict:
    return {"input": i, "output": o, "testtype": "stdin"}


def dag(levels: int) -> bytes:
    """``x = []`` then ``levels`` times ``x = [x, x]`` through the memo: a few bytes a level, 2**levels leaves."""
    out = b"\x80\x04]\x94"  # PROTO 4, EMPTY_LIST, MEMOIZE (memo 0)
    for k in range(levels):  # EMPTY_LIST, MARK, BINGET k, BINGET k, APPENDS, MEMOIZE (memo k+1), POP
        out += b"](h" + bytes([k]) + b"h" + bytes([k]) + b"e\x940"
    return out + b"h" + bytes([levels]) + b"."


def nones(k: int) -> bytes:
    """PROTO, EMPTY_LIST, MARK, ``k`` NONE, APPENDS, STOP: ``k + 5`` opcodes, one container."""
    return b"\x80\x04](" + b"N" * k + b"e."


def tuples(k: int) -> bytes:
    """A list of ``k`` empty tuples: ``k + 1`` containers, ``k + 5`` opcodes."""
    return b"\x80\x04](" + b")" * k + b"e."


def nest(levels: int) -> list:
    value: list = [1]
    for _ in range(levels - 1):
        value = [value]
    return value


# ----------------------------------------------------------------------------- blobs: bounded, linear
def test_memo_reads_are_refused_so_a_579_byte_dag_never_expands():
    with pytest.raises(UnsafeBlob, match="uses BINGET: a memo read"):
        load_plain(dag(2))  # small enough that, admitted, it would load: the refusal is the rule, not the size
    start = time.monotonic()
    with pytest.raises(UnsafeBlob, match="uses BINGET: a memo read"):
        decode_blob(blob(dag(40)))  # 2**40 leaves once loaded: the plain-data walk never ended
    assert time.monotonic() - start < GUARD_S
    with pytest.raises(UnsafeBlob, match="uses DUP"):
        load_plain(b"\x80\x04]2\x86.")  # EMPTY_LIST, DUP, TUPLE2: one list twice without the memo
    with pytest.raises(UnsafeBlob, match="uses GET"):
        load_plain(b"(lp0\ng0\na.")  # protocol 0's memo read
    # near miss: memo writes, which every protocol's pickle of the official JSON string holds, load
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert load_plain(pickle.dumps([["a"], ("b",), {"c": 1.5}], protocol=protocol)) == [["a"], ("b",), {"c": 1.5}]


def test_the_opcode_bound_is_exact_and_a_huge_pickle_is_refused_at_it():
    assert load_plain(nones(MAX_OPCODES - 5)) == [None] * (MAX_OPCODES - 5)
    with pytest.raises(UnsafeBlob, match=f"more than {MAX_OPCODES} opcodes"):
        load_plain(nones(MAX_OPCODES - 4))
    start = time.monotonic()
    with pytest.raises(UnsafeBlob, match=f"more than {MAX_OPCODES} opcodes"):
        decode_blob(blob(nones(20_000_000)))  # 20 M opcodes in 20 kB of zlib: the scan stops at the bound
    assert time.monotonic() - start < GUARD_S


def test_the_container_bound_is_exact():
    assert load_plain(tuples(MAX_CONTAINERS - 1)) == [()] * (MAX_CONTAINERS - 1)
    with pytest.raises(UnsafeBlob, match=f"more than {MAX_CONTAINERS} containers"):
        load_plain(tuples(MAX_CONTAINERS))


def test_the_depth_bound_is_exact():
    assert MAX_DEPTH == 64
    assert load_plain(pickle.dumps(nest(64), protocol=4)) == nest(64)
    with pytest.raises(UnsafeBlob, match="more than 64 levels"):
        load_plain(pickle.dumps(nest(65), protocol=4))
    assert load_plain(pickle.dumps({"k": nest(63)}, protocol=4)) == {"k": nest(63)}  # a dict is a level too
    with pytest.raises(UnsafeBlob, match="more than 64 levels"):
        load_plain(pickle.dumps({"k": nest(64)}, protocol=4))


def test_a_memo_index_past_the_opcodes_is_refused_before_the_unpickler_sizes_its_memo():
    tracemalloc.start()
    try:  # LONG_BINPUT 2**20: the C unpickler would allocate a memo of 2**21 slots (16 MB) for it
        with pytest.raises(UnsafeBlob, match="memo index"):
            load_plain(b"\x80\x04Nr" + (1 << 20).to_bytes(4, "little") + b".")
        assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()
    assert load_plain(b"\x80\x04Nr" + (1).to_bytes(4, "little") + b".") is None  # an index the opcodes reach


# ----------------------------------------------------------------------------- records: one line each
def _rows() -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / "test.jsonl").read_text().splitlines()]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_dag_record_is_one_line_naming_file_line_question_and_the_rule(tmp_path):
    rows = _rows()
    rows[1]["private_test_cases"] = blob(dag(40))
    path = _write(tmp_path / "test.jsonl", rows)
    assert len(json.dumps(rows[1]["private_test_cases"])) < 600  # the 579-byte line
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        get_task("livecodebench", data=str(path), unsafe_exec=True)
    assert time.monotonic() - start < GUARD_S
    msg = str(err.value)
    assert "\n" not in msg and f"{path}:2: question 'cf1900_b': field 'private_test_cases'" in msg and "BINGET" in msg


def test_the_test_count_bound_is_exact_public_and_private_together(tmp_path):
    rows = _rows()  # line 1: abc900_a with one public test
    for private, refused in ((MAX_TESTS - 1, False), (MAX_TESTS, True)):
        rows[0]["private_test_cases"] = packed([stdin_test("1\n5\n", "5\n5\n")] * private)
        path = _write(tmp_path / "test.jsonl", rows)
        if refused:
            with pytest.raises(DataError, match=rf"test.jsonl:1: question 'abc900_a': field 'private_test_cases': "
                                                rf"{MAX_TESTS + 1} tests, public and private together; a problem may "
                                                rf"have at most {MAX_TESTS}"):
                get_task("livecodebench", data=str(path), unsafe_exec=True)
        else:
            task = get_task("livecodebench", data=str(path), unsafe_exec=True)
            assert len(task.cases(_inst(task, "abc900_a"))) == MAX_TESTS
    rows[0]["private_test_cases"] = "[]"
    rows[0]["public_test_cases"] = json.dumps([stdin_test("1\n", "1\n")] * (MAX_TESTS + 1))
    with pytest.raises(DataError, match=f"{MAX_TESTS + 1} tests"):
        get_task("livecodebench", data=str(_write(tmp_path / "test.jsonl", rows)), unsafe_exec=True)


def test_the_argument_bound_of_a_call_based_test_is_exact(tmp_path):
    rows = _rows()  # line 3: lc3000, call-based
    for lines, refused in ((MAX_ARGS, False), (MAX_ARGS + 1, True)):
        rows[2]["public_test_cases"] = json.dumps([{"input": "\n".join(["1"] * lines), "output": "1",
                                                    "testtype": "functional"}])
        path = _write(tmp_path / "test.jsonl", rows)
        if refused:
            with pytest.raises(DataError, match=rf"test.jsonl:3: question 'lc3000': field 'public_test_cases': test 0 "
                                                rf"of a call-based problem has more than {MAX_ARGS} input lines"):
                get_task("livecodebench", data=str(path), unsafe_exec=True)
        else:
            assert get_task("livecodebench", data=str(path), unsafe_exec=True).eval_size == 3
    rows[2]["public_test_cases"] = json.dumps([{"input": "1\n" * 1_000_000, "output": "1", "testtype": "functional"}])
    start = time.monotonic()
    with pytest.raises(DataError, match="more than"):
        get_task("livecodebench", data=str(_write(tmp_path / "test.jsonl", rows)), unsafe_exec=True)
    assert time.monotonic() - start < GUARD_S


# ----------------------------------------------------------------------------- grading in the sandbox
SUM_MAX = "n = int(input())\na = list(map(int, input().split()))\n"


@pytest.fixture(scope="module")
def task():
    return get_task("livecodebench", data=str(FIXTURES), release_version="release_v2", timeout_s=0.25)


def _inst(task, qid):
    return next(i for i in task.instances(task.eval_size, 0, "eval") if i.meta["question_id"] == qid)


SPIN_FUNCTION = ("import time\n\ndef f(seconds):\n    end = time.monotonic() + seconds\n"
                 "    while time.monotonic() < end:\n        pass\n    return seconds\n")


def test_a_call_is_timed_outside_the_candidate_and_the_candidate_killed_at_the_limit():
    tests = "assert f(0) == 0\nassert f(0.05) == 0.05\n"
    ok = run_tests(SPIN_FUNCTION, tests, "f", timeout_s=30, call_timeout_s=0.5)
    assert ok.passed, ok.reason
    assert ok.python == sandbox_python(check_isolation())  # the interpreter that ran is named
    late = run_tests(SPIN_FUNCTION, "assert f(0) == 0\nassert f(60) == 60\n", "f", timeout_s=30, call_timeout_s=0.5)
    assert not late.passed and not late.timed_out
    assert late.reason == "call 2: time limit exceeded (no reply within 0.5 s)"
    assert late.duration_s < 10  # ended at the call's limit, not the run's 30 s nor the candidate's 60 s
    with pytest.raises(ValueError, match="call_timeout_s"):
        run_tests(SPIN_FUNCTION, tests, "f", call_timeout_s=0)


def _exact_rows(tmp_path: Path) -> Path:
    rows = _rows()
    big = 123456789012345678901  # 21 digits: floats hold 17
    rows[0]["public_test_cases"] = json.dumps([stdin_test("", f"{big}\n")])
    rows[0]["private_test_cases"] = "[]"
    rows[2]["public_test_cases"] = json.dumps([{"input": "[1]\n0", "output": str(big), "testtype": "functional"}])
    rows[2]["private_test_cases"] = "[]"
    return _write(tmp_path / "test.jsonl", [rows[0], rows[2]])


@pytest.mark.parametrize("qid, answer, passes", [
    ("abc900_a", "print(123456789012345678901)", True),
    ("abc900_a", "print(123456789012345678902)", False),  # differs in the 21st digit: floats would call it equal
    ("lc3000", "class Solution:\n    def twoSum(self, nums, target):\n        return 123456789012345678901", True),
    ("lc3000", "class Solution:\n    def twoSum(self, nums, target):\n        return 123456789012345678902", False),
])
def test_numbers_compare_exactly(tmp_path, qid, answer, passes):
    task = get_task("livecodebench", data=str(_exact_rows(tmp_path)), timeout_s=0.25)
    result = task.run(_inst(task, qid), f"```python\n{answer}\n```")
    assert result.passed is passes, result.reason
    assert lines_match("123456789012345678901", "123456789012345678902") is False
    assert lines_match("1 123456789012345678901", "1 123456789012345678901.0") is True  # equal as Decimals
    assert lines_match("123456789012345678901", "1.2345678901234568e+20") is False  # float() would call them equal


@pytest.mark.parametrize("code", [
    SUM_MAX + "print(sum(a))\nprint(max(a))\nquit()\n",  # official: builtins.quit is None, a runtime error
    "import sys\nn = int(sys.stdin.buffer.readline())\na = list(map(int, sys.stdin.buffer.readline().split()))\n"
    "print(sum(a))\nprint(max(a))\n",  # official: its StringIO stdin has no .buffer, a runtime error
    "n = int(stdin.readline())\na = list(map(int, stdin.readline().split()))\nprint(sum(a), file=stdout)\n"
    "print(max(a), file=stdout)\n",  # official: `from sys import *` binds the real streams
    "import sys\nlines = [line for line in sys.stdin]\na = list(map(int, lines[1].split()))\n"
    "print(sum(a))\nprint(max(a))\n",  # iterating sys.stdin: passes in both (agreement, not a departure)
])
def test_departures_from_the_official_grader_pass_as_under_a_judge(task, code):
    result = task.run(_inst(task, "abc900_a"), f"```python\n{code}```")
    assert result.passed, result.reason


def test_a_library_only_the_evaluator_has_is_env_missing_naming_the_interpreter(task, tmp_path, monkeypatch, capsys):
    (tmp_path / "dlm_lcb_only_here.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here, never inside the sandbox
    inst = _inst(task, "abc900_a")
    right = SUM_MAX + "print(sum(a))\nprint(max(a))\n"
    insts = task.instances(task.eval_size, 0, "eval")
    assert task.score(inst, f"```python\nimport dlm_lcb_only_here\n{right}```") == 0.0
    assert task.env_missing == {"abc900_a": "dlm_lcb_only_here"}
    capsys.readouterr()
    assert task.extra_metrics(insts, [0.0] * len(insts))["env_missing"] == 1.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "env_missing: 1 problem(s)" in err and "dlm_lcb_only_here (1)" in err
    assert f"({task.sandbox_python})" in err
    # near miss: a module nobody has is the answer's own failure (and the latest scoring is what counts)
    assert task.score(inst, f"```python\nimport dlm_no_such_module_anywhere\n{right}```") == 0.0
    assert task.env_missing == {} and task.extra_metrics(insts, [0.0] * len(insts))["env_missing"] == 0.0


def test_the_task_says_which_interpreter_the_sandbox_runs(capsys):
    task = get_task("livecodebench", data=str(FIXTURES / "test.jsonl"))
    err = capsys.readouterr().err
    differs = os.path.realpath(task.sandbox_python) != os.path.realpath(sys.executable)
    assert (f"the sandbox runs {task.sandbox_python}, not the evaluator's" in err) is differs
    assert os.path.isfile(task.sandbox_python)
