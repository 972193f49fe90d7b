"""LiveCodeBench: release files (versions, dates, every malformed field), blobs that are never
unpickled, the official prompt and extraction, and the grader's verdicts in the sandbox (the
known-correct solution passes and its near-misses fail, for every fixture problem)."""

from __future__ import annotations

import base64
import copyreg
import io
import json
import os
import pickle
import pickletools
import shutil
import tracemalloc
import zlib
from pathlib import Path

import pytest

from dlm_toolkit.cli import main
from dlm_toolkit.tasks import get_task
from dlm_toolkit.tasks.data import DataError
from dlm_toolkit.tasks.livecodebench import RELEASE_FILES, extract_code, lcb_prompt
from dlm_toolkit.tasks.safe_pickle import UnsafeBlob, _NoGlobals, decode_blob, inflate_bounded, load_plain
from dlm_toolkit.tasks.stdio import lines_match, run_timeout

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "livecodebench"
TESTBED = str(Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-editable")
FIELDS = ("question_title", "question_content", "platform", "question_id", "contest_id", "contest_date",
          "starter_code", "difficulty", "public_test_cases", "private_test_cases", "metadata")


def blob(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data)).decode()


# ----------------------------------------------------------------------------- blobs, never unpickled
@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickled_json_string_decodes_at_every_protocol(protocol):
    text = json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}])
    assert decode_blob(blob(pickle.dumps(text, protocol=protocol))) == text


def _global_pickles(marker: Path) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    return {
        "GLOBAL+REDUCE": b"cos\nsystem\n(S'" + cmd.encode() + b"'\ntR.",
        "STACK_GLOBAL+REDUCE": b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(cmd)]) + cmd.encode()
                               + b"\x85R.",
        "INST": b"(S'" + cmd.encode() + b"'\nios\nsystem\n.",
        "OBJ": b"(cos\nsystem\nS'" + cmd.encode() + b"'\no.",
        "EXT1": b"\x80\x02\x82\x01)R.",
    }


@pytest.mark.parametrize("kind", ["GLOBAL+REDUCE", "STACK_GLOBAL+REDUCE", "INST", "OBJ", "EXT1"])
def test_a_pickle_naming_a_global_is_refused_and_nothing_runs(kind, tmp_path):
    marker = tmp_path / "ran"
    data = _global_pickles(marker)[kind]
    if kind != "EXT1":
        pickletools.dis(data, out=open(tmp_path / "dis.txt", "w"))  # a well-formed pickle: refused for its global
        assert "system" in (tmp_path / "dis.txt").read_text()
    first = {"OBJ": "GLOBAL"}.get(kind, kind.split("+")[0])  # OBJ's pickle names its class with GLOBAL first
    with pytest.raises(UnsafeBlob, match=f"the pickle uses {first}"):  # layer 1: the opcode scan
        decode_blob(blob(data))
    assert not marker.exists()
    copyreg.add_extension("os", "system", 1)  # so that EXT1 1 means os.system, as a hostile registry would
    try:
        with pytest.raises(UnsafeBlob, match="names the global os.system"):  # layer 2 alone: no global resolves
            _NoGlobals(io.BytesIO(data)).load()
    finally:
        copyreg.remove_extension("os", "system", 1)
    assert not marker.exists()


def test_persistent_ids_and_non_plain_containers_are_refused():
    with pytest.raises(UnsafeBlob, match="BINPERSID"):
        load_plain(b"\x80\x02X\x01\x00\x00\x00aQ.")
    with pytest.raises(UnsafeBlob, match="persistent id"):  # the unpickler alone refuses it too
        _NoGlobals(io.BytesIO(b"\x80\x02X\x01\x00\x00\x00aQ.")).load()
    with pytest.raises(UnsafeBlob, match="uses EMPTY_SET"):
        load_plain(pickle.dumps({1, 2}, protocol=4))  # EMPTY_SET + ADDITEMS: an object without any global
    with pytest.raises(UnsafeBlob, match="uses FROZENSET"):
        load_plain(pickle.dumps(frozenset({1}), protocol=4))
    assert load_plain(pickle.dumps({"a": [1, 2.5, b"x", None, True, ("t",)]}, protocol=4)) == \
        {"a": [1, 2.5, b"x", None, True, ("t",)]}


def test_broken_base64_zlib_and_pickle_are_refused():
    good = pickle.dumps("[]")
    raw = zlib.compress(good)
    with pytest.raises(UnsafeBlob, match="base64"):
        decode_blob("not base64!!")
    with pytest.raises(UnsafeBlob, match="zlib"):
        decode_blob(base64.b64encode(b"garbage that is no zlib").decode())
    with pytest.raises(UnsafeBlob, match="truncated"):
        decode_blob(base64.b64encode(raw[:-3]).decode())
    with pytest.raises(UnsafeBlob, match="after the zlib"):
        decode_blob(base64.b64encode(raw + b"xx").decode())
    with pytest.raises(UnsafeBlob, match="after the pickle"):
        decode_blob(blob(good + b"junk"))
    with pytest.raises(UnsafeBlob, match="not a valid pickle"):
        decode_blob(blob(good[:-1]))  # no STOP
    tracemalloc.start()
    try:  # a declared length of 1 TiB with three bytes behind it: a truncation, nothing allocated
        with pytest.raises(UnsafeBlob, match="not a valid pickle"):
            load_plain(b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"abc")
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    assert decode_blob(blob(good)) == "[]"


def test_the_decompressed_size_bound_is_exact():
    data = b"x" * 1000
    assert inflate_bounded(zlib.compress(data), 1000) == data
    with pytest.raises(UnsafeBlob, match="more than 999 bytes"):
        inflate_bounded(zlib.compress(data), 999)


def test_a_zip_bomb_is_refused_without_inflating_it():
    bomb = zlib.compressobj(9)
    packed = b"".join(bomb.compress(b"\0" * (1 << 20)) for _ in range(64)) + bomb.flush()  # 64 MiB of zeros
    assert len(packed) < 1 << 17
    text = base64.b64encode(packed).decode()
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeBlob, match="more than"):
            decode_blob(text, max_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


# ----------------------------------------------------------------------------- release files
def ids(task) -> list[str]:
    return [i.meta["question_id"] for i in task.instances(task.eval_size, 0, "eval")]


def test_release_versions_read_their_files():
    assert RELEASE_FILES["release_v1"] == ("test.jsonl",)
    assert RELEASE_FILES["release_v3"] == ("test.jsonl", "test2.jsonl", "test3.jsonl")
    assert RELEASE_FILES["v2"] == ("test2.jsonl",)
    assert RELEASE_FILES["v2_v4"] == ("test2.jsonl", "test3.jsonl", "test4.jsonl")
    assert len(RELEASE_FILES["release_v6"]) == 6 and RELEASE_FILES["release_latest"] == RELEASE_FILES["release_v6"]
    kw = dict(data=str(FIXTURES), unsafe_exec=True)
    assert ids(get_task("livecodebench", release_version="release_v1", **kw)) == ["abc900_a", "cf1900_b", "lc3000"]
    assert ids(get_task("livecodebench", release_version="release_v2", **kw)) == \
        ["abc900_a", "cf1900_b", "lc3000", "abc950_b"]
    assert ids(get_task("livecodebench", release_version="v2", **kw)) == ["abc950_b"]
    assert ids(get_task("livecodebench", data=str(FIXTURES / "test.jsonl"), unsafe_exec=True)) == \
        ["abc900_a", "cf1900_b", "lc3000"]  # one file: read whole
    with pytest.raises(DataError, match="test3.jsonl"):  # release_v3 needs a file the folder lacks
        get_task("livecodebench", release_version="release_v3", **kw)


@pytest.mark.parametrize("start, end, expected", [
    ("2024-09-15", None, ["cf1900_b", "lc3000", "abc950_b"]),  # the start day is in (2024-09-15T00:00)
    ("2024-09-16", None, ["lc3000", "abc950_b"]),
    (None, "2025-03-01", ["abc900_a", "cf1900_b", "lc3000"]),  # the end day is in
    (None, "2025-02-28", ["abc900_a", "cf1900_b"]),
    ("2025-02-01", "2025-05-01", ["lc3000", "abc950_b"]),
])
def test_contest_dates_filter_as_the_official_runner(start, end, expected):
    task = get_task("livecodebench", data=str(FIXTURES), release_version="release_v2", start_date=start,
                    end_date=end, unsafe_exec=True)
    assert ids(task) == expected


def test_no_problem_in_the_window_and_a_bad_date_are_one_line():
    with pytest.raises(DataError, match="no problem"):
        get_task("livecodebench", data=str(FIXTURES), release_version="v1", start_date="2030-01-01", unsafe_exec=True)
    with pytest.raises(Exception, match="start_date: '2024/01/01' is not a date"):
        get_task("livecodebench", data=str(FIXTURES), start_date="2024/01/01", unsafe_exec=True)
    with pytest.raises(Exception, match="release_version: 'release_v9'"):
        get_task("livecodebench", data=str(FIXTURES), release_version="release_v9", unsafe_exec=True)


def _rows() -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / "test.jsonl").read_text().splitlines()]


def _bad(mutate) -> list[dict]:
    rows = _rows()
    mutate(rows[1])  # line 2
    return rows


def _global_blob() -> str:
    return blob(b"cos\nsystem\n(S'true'\ntR.")


@pytest.mark.parametrize("mutate, field, what", [
    (lambda r: r.pop("difficulty"), None, "missing field(s) 'difficulty'"),
    (lambda r: r.update(platform="topcoder"), "platform", "'topcoder' is not one of"),
    (lambda r: r.update(difficulty="trivial"), "difficulty", "is not one of"),
    (lambda r: r.update(contest_date="yesterday"), "contest_date", "not an ISO date"),
    (lambda r: r.update(question_content=7), "question_content", "must be a string"),
    (lambda r: r.update(public_test_cases="[{"), "public_test_cases", "not JSON"),
    (lambda r: r.update(public_test_cases=json.dumps([{"input": "1"}])), "public_test_cases", "test 0 must be"),
    (lambda r: r.update(private_test_cases="@@not base64@@"), "private_test_cases", "base64"),
    (lambda r: r.update(private_test_cases=base64.b64encode(b"no zlib here").decode()), "private_test_cases", "zlib"),
    (lambda r: r.update(private_test_cases=blob(b"\x80\x04junk")), "private_test_cases", "pickle"),
    (lambda r: r.update(private_test_cases=_global_blob()), "private_test_cases", "uses GLOBAL os.system"),
    (lambda r: r.update(private_test_cases=blob(pickle.dumps([1, 2]))), "private_test_cases", "JSON string"),
    (lambda r: r.update(private_test_cases=blob(pickle.dumps("{]"))), "private_test_cases", "not JSON"),
    (lambda r: r.update(metadata=json.dumps({"func_name": "not a name"})), "metadata", "not a Python identifier"),
    (lambda r: r.update(metadata="[]"), "metadata", "JSON object"),
    (lambda r: r.update(metadata=json.dumps({"func_name": "f"}),
                        public_test_cases=json.dumps([{"input": "[1", "output": "1", "testtype": "functional"}])),
     "public_test_cases", "not JSON"),
    (lambda r: r.update(metadata="[" * 65 + "]" * 65), "metadata", "nested 65 levels deep; at most 64"),
    (lambda r: r.update(public_test_cases="[" * 5000 + "]" * 5000), "public_test_cases", "nested 5000 levels deep"),
    (lambda r: r.update(metadata=json.dumps({"func_name": "f"}), public_test_cases=json.dumps(
        [{"input": "[" * 100_000 + "]" * 100_000, "output": "1", "testtype": "functional"}])),
     "public_test_cases", "nested 100000 levels deep"),
])
def test_every_malformed_field_is_one_line_naming_file_line_and_field(tmp_path, mutate, field, what):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _bad(mutate)))
    with pytest.raises(DataError) as err:
        get_task("livecodebench", data=str(path), unsafe_exec=True)
    msg = str(err.value)
    assert "\n" not in msg and f"{path}:2:" in msg and what in msg
    if field is not None:
        assert f"field '{field}'" in msg


def test_private_tests_over_the_size_bound_are_refused(tmp_path):
    rows = _rows()
    big = [{"input": "x" * 600_000, "output": "y", "testtype": "stdin"}] * 2  # ~1.2 MB of JSON, packs small
    rows[0]["private_test_cases"] = blob(pickle.dumps(json.dumps(big)))
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"test.jsonl:1: question 'abc900_a': field 'private_test_cases'.*more than 1048576 bytes"):
        get_task("livecodebench", data=str(path), max_test_mb=1, unsafe_exec=True)
    assert get_task("livecodebench", data=str(path), max_test_mb=2, unsafe_exec=True).eval_size == 3


def test_a_line_over_the_bound_is_refused_before_it_is_parsed(tmp_path):
    rows = _rows()
    path = tmp_path / "test.jsonl"
    for size, refused in ((3 << 20, False), ((3 << 20) + 1, True)):  # bound: 2 * 1 MiB + 1 MiB (max_test_mb=1)
        rows[2]["question_content"] = ""  # the line's length without it, then filled to exactly `size` bytes
        rows[2]["question_content"] = "q" * (size - len(json.dumps(rows[2])) - 1)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        if refused:
            with pytest.raises(DataError, match=r"test.jsonl:3: a line longer than 3145728 bytes"):
                get_task("livecodebench", data=str(path), max_test_mb=1, unsafe_exec=True)
        else:
            assert get_task("livecodebench", data=str(path), max_test_mb=1, unsafe_exec=True).eval_size == 3


def test_cli_refuses_a_malformed_file_with_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _bad(lambda r: r.update(private_test_cases=_global_blob()))))
    code = main(["eval", "--checkpoint", TESTBED, "--task", "livecodebench", "--n", "1", "--data", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "GLOBAL os.system" in err and ":2:" in err


# ----------------------------------------------------------------------------- prompt, extraction
def test_prompt_is_the_official_generic_format():
    system = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
              "generate a correct Python program that matches the specification and passes all tests. You will NOT "
              "return anything except for the program.")
    assert lcb_prompt("Add.", "") == (
        system + "\n\n### Question:\nAdd.\n\n### Format: Read the inputs from stdin solve the problem and write the "
        "answer to stdout (do not directly test on the sample inputs). Enclose your code within delimiters as "
        "follows.\n```python\n# YOUR CODE HERE\n```\n\n### Answer: (use the provided format with backticks)\n\n")
    assert lcb_prompt("Add.", "class Solution:\n    def f(self):\n        ") == (
        system + "\n\n### Question:\nAdd.\n\n### Format: You will use the following starter code to write the "
        "solution to the problem and enclose your code within delimiters.\n```python\nclass Solution:\n    def "
        "f(self):\n        \n```\n\n### Answer: (use the provided format with backticks)\n\n")


@pytest.mark.parametrize("completion, code", [
    ("```python\nprint(1)\n```", "print(1)"),
    ("text\n```python\nprint(1)\n```\nmore\n```python\nprint(2)\nprint(3)\n```\n", "print(2)\nprint(3)"),  # the last
    ("```python\nprint(1)\n", ""),  # an unclosed fence: no program (official)
    ("print(1)", ""),
    ("```\na\n```\nb\n```", "b"),  # three fence lines: between the last two, as the official extraction
])
def test_code_is_extracted_as_the_official_runner_does(completion, code):
    assert extract_code(completion) == code


@pytest.mark.parametrize("got, expected, same", [
    ("6\n3\n", "6\n3\n", True),
    ("  6  \n3\n\n\n", "6\n3", True),  # each line stripped, the whole stripped
    ("Yes  \n  No\n", "Yes\nNo", True),  # words: only stripping makes them equal
    ("6\n3", "6\n4", False),
    ("6", "6\n3", False),  # a missing line
    ("6\n\n3", "6\n3", False),  # an extra blank line inside
    ("2.5", "2.500000", True),  # equal as decimals
    ("1.3333333333333333", "1.333333", False),  # not within any tolerance: decimals must be equal
    ("1e2 3", "100 3.0", True),
    ("1 2", "1  2", True),  # not equal as text, equal as numbers
    ("a b", "a  b", False),  # words are compared as text
    ("nan", "nan", True),  # equal text
])
def test_stdout_lines_match_as_the_official_grader(got, expected, same):
    assert lines_match(got, expected) is same


def test_whole_run_timeout_is_the_official_global_one():
    assert run_timeout(6.0, 10) == 75.0


def test_per_group_metrics_are_hand_computed():
    task = get_task("livecodebench", data=str(FIXTURES), release_version="release_v2", unsafe_exec=True)
    insts = task.instances(4, 0, "eval")  # easy atcoder, medium codeforces, easy leetcode, hard atcoder
    assert task.extra_metrics(insts, [1.0, 0.0, 0.0, 1.0]) == {
        "accuracy_atcoder": 1.0, "accuracy_codeforces": 0.0, "accuracy_easy": 0.5, "accuracy_hard": 1.0,
        "accuracy_leetcode": 0.0, "accuracy_medium": 0.0, "env_missing": 0.0}


# ----------------------------------------------------------------------------- grading in the sandbox
SUM_MAX = "n = int(input())\na = list(map(int, input().split()))\n"
TWO_SUM = ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        seen = {}\n"
           "        for i, x in enumerate(nums):\n            if target - x in seen:\n"
           "                return [seen[target - x], i]\n            seen[x] = i\n")
SPIN = "while True:\n    pass\n"
CASES = {  # problem -> [(solution, passes, reason fragment)]
    "abc900_a": [
        (SUM_MAX + "print(sum(a))\nprint(max(a))\n", True, ""),
        (SUM_MAX + "print(sum(a))\nprint(max(a))\nexit()\n", True, ""),  # exit() ends a stdin program normally
        (SUM_MAX + "print(sum(a), ' ')\nprint(max(a))\nimport sys\nsys.exit(0)\n", True, ""),
        (SUM_MAX + "print(sum(a) + 1)\nprint(max(a))\n", False, "wrong answer"),  # off by one
        (SUM_MAX + "print(sum(a))\n", False, "wrong answer"),  # a missing line
        (SUM_MAX + "print(sum(a))\nprint(max(a))\n" + SPIN, False, "time limit exceeded"),
        (SUM_MAX + "print(sum(a))\nprint(max(a))\nwhile True:\n    print('x' * 1000)\n", False, "flood"),
        (SUM_MAX + "print(sum(a))\nprint(max(a))\nraise ValueError('late')\n", False, "ValueError"),
        (SUM_MAX + "import time\ntry:\n    t = time.monotonic()\n    while time.monotonic() - t < 20:\n        pass\n"
         "except BaseException:\n    pass\nprint(sum(a))\nprint(max(a))\n", False,
         "call 1: time limit exceeded"),  # catching whatever it can: no timer in its process, killed from outside
    ],
    "cf1900_b": [
        ("import sys\nn, *a = map(int, sys.stdin.read().split())\nprint(f'{sum(a) / n:.6f}')\n", True, ""),
        ("import sys\nn, *a = map(int, sys.stdin.buffer.read().split())\nprint(f'{sum(a) / n:.6f}'.rstrip('0'))\n",
         True, ""),  # '2.5' for '2.500000': equal as decimals
        ("import sys\nn, *a = map(int, sys.stdin.read().split())\nprint(sum(a) / n)\n", False, "wrong answer"),
        ("import sys\nn, *a = map(int, sys.stdin.read().split())\nprint(f'{sum(a) / n + 1e-6:.6f}')\n", False,
         "wrong answer"),  # a wrong float
        ("import sys\nn, *a = map(int, sys.stdin.read().split())\n", False, "wrong answer"),  # the line missing
        ("import sys\nn, *a = map(int, sys.stdin.read().split())\nprint(f'{sum(a) / n:.6f}')\n" + SPIN, False,
         "time limit exceeded"),
        ("import sys\nn, *a = map(int, sys.stdin.read().split())\nwhile True:\n    sys.stdout.write('1.0 ' * 999)\n",
         False, "flood"),
    ],
    "lc3000": [
        (TWO_SUM, True, ""),
        (TWO_SUM.replace("return [seen[target - x], i]", "return (seen[target - x], i)"), True, ""),  # a tuple: a list
        (TWO_SUM.replace("return [seen[target - x], i]", "print('x' * 10**6)\n                "
                                                          "return [seen[target - x], i]"), True, ""),  # stdout ignored
        (TWO_SUM.replace("return [seen[target - x], i]", "return [seen[target - x], i + 1]"), False, "wrong answer"),
        (TWO_SUM.replace("seen = {}", "seen = {}\n        " + SPIN.replace("\n    ", "\n            ")), False,
         "time limit exceeded"),
        (TWO_SUM.replace("return [seen[target - x], i]", "return iter([seen[target - x], i])"), False,
         "not plain data"),
        ("class Solution:\n    def other(self):\n        return 1\n", False, "while loading the solution"),
        ("while True:\n    pass\n" + TWO_SUM, False, "call 1: time limit exceeded"),  # the load is timed
        ("try:\n    while True:\n        pass\nexcept BaseException:\n    pass\n" + TWO_SUM, False,
         "call 1: time limit exceeded"),
    ],
    "abc950_b": [
        ("print(' '.join(open(0).read().split()[::-1]))\n", True, ""),
        ("print(' '.join(input().split()))\n", False, "wrong answer"),
        ("w = input().split()\nprint(' '.join(w[::-1][1:]))\n", False, "wrong answer"),  # one word short
        ("w = input().split()\n", False, "wrong answer"),  # the line missing
        ("w = input().split()\nprint(' '.join(w[::-1]))\n" + SPIN, False, "time limit exceeded"),
        ("w = input().split()\nwhile True:\n    print(' '.join(w[::-1]) * 1000)\n", False, "flood"),  # the cap is
        # 16 Mi characters on the candidate's side (stdio.MAX_OUTPUT_CHARS): short lines reach it after the time limit
    ],
}


@pytest.fixture(scope="module")
def task():
    return get_task("livecodebench", data=str(FIXTURES), release_version="release_v2", timeout_s=0.25)


@pytest.mark.parametrize("qid, k", [(q, k) for q, cases in CASES.items() for k in range(len(cases))])
def test_correct_solutions_pass_and_near_misses_fail(task, qid, k):
    inst = next(i for i in task.instances(4, 0, "eval") if i.meta["question_id"] == qid)
    code, passes, reason = CASES[qid][k]
    result = task.run(inst, f"Here:\n```python\n{code}```\n")
    assert result.passed is passes, (result.reason, result.candidate_stderr_tail[-500:])
    assert reason in result.reason


def test_an_answer_without_a_fenced_block_scores_zero(task):
    inst = task.instances(1, 0, "eval")[0]
    assert task.score(inst, CASES["abc900_a"][0][0]) == 0.0  # the right program, but not in a fence


def test_readme_command_runs_end_to_end_on_the_testbed(tmp_path, capsys):
    # The official prompt alone (~600 characters) exceeds the testbed's 256 positions: a copy that
    # claims 1024 runs the whole command (its answers past 256 are noise; the plumbing is what is tested).
    shutil.copytree(TESTBED, tmp_path / "testbed")
    config = json.loads((tmp_path / "testbed" / "config.json").read_text())
    (tmp_path / "testbed" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    code = main(["eval", "--checkpoint", str(tmp_path / "testbed"), "--task", "livecodebench", "--data", str(FIXTURES / "test.jsonl"), "--n", "3",
                 "--gen-length", "32", "--chat", "false", "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["task"] == "livecodebench" and out["metric_name"] == "pass@1" and out["n"] == 3
    assert {"accuracy_easy", "accuracy_medium", "accuracy_atcoder", "accuracy_leetcode"} <= set(out)
    assert out["tokens_per_second"] > 0 and out["tpf"] > 0


def test_the_sweep_experiment_validates():
    import yaml

    from dlm_toolkit.sweep.experiment import load_experiment

    root = Path(__file__).resolve().parents[1]
    data = yaml.safe_load((root / "experiments" / "llada2.1-livecodebench.yaml").read_text())
    assert data["task"] == "livecodebench" and data["task_args"]["release_version"] == "release_v6"
    data["model"] = TESTBED  # the checkpoint and data the README puts in place are not here: ours instead
    data["task_args"] = {**data["task_args"], "data": str(FIXTURES), "release_version": "release_v2"}
    exp = load_experiment(data)
    assert exp.task_args["start_date"] == "2024-08-01" and exp.task_args["end_date"] == "2025-05-01"


def test_release_files_are_read_only_as_regular_files_with_the_shared_depth_bound(tmp_path):
    """A JSON line nested 100,000 deep, a FIFO and a /proc file of size 0 are one line each (no
    RecursionError, no hang, no endless read); near miss: a record whose metadata nests exactly 64
    levels loads."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"deep.jsonl:1: JSON nested 100000 levels deep; at most 64"):
        get_task("livecodebench", data=str(deep), unsafe_exec=True)
    fifo = tmp_path / "release.fifo"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="must be a regular file, this is a FIFO"):
        get_task("livecodebench", data=str(fifo), unsafe_exec=True)
    with pytest.raises(DataError, match="of size 0"):
        get_task("livecodebench", data="/proc/self/pagemap", unsafe_exec=True)
    rows = _rows()
    meta = json.loads(rows[0]["metadata"])
    rows[0]["metadata"] = json.dumps({**meta, "nest": json.loads("[" * 63 + "]" * 63)})  # 64 levels with the object
    ok = tmp_path / "test.jsonl"
    ok.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert get_task("livecodebench", data=str(ok), unsafe_exec=True).eval_size == len(rows)
