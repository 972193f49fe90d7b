"""Holes found by attacking the issue-42 defences as merged (each row failed before its fix), and the
two leftovers: a C-speed ``json_depth`` checked against the old regex definition, and one sandbox
probe shared by a task and its runner (a busy uid pool is said as such, and not remembered)."""

from __future__ import annotations

import json
import os
import random
import re
import sys
from itertools import accumulate

import pytest

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import json_depth
from test_hostile_inputs_v3 import trap  # noqa: F401  (fixture: an lm-eval task folder whose utils.py marks its import)
from test_sandbox_limits import small_pool  # noqa: F401  (fixture: a pool of three uids of this test's own)

# --------------------------------------------------------------------- privileges from a training config


@pytest.mark.parametrize("task,params,needle", [
    ("lm_eval", {"task": "dlm_trap", "include_path": "{folder}", "allow_import": True},
     "task_params.lm_eval.allow_import: a privilege only the command line grants (`dlm eval/sweep --allow-import`)"),
    ("humaneval", {"unsafe_exec": True},
     "task_params.humaneval.unsafe_exec: a privilege only the command line grants (`dlm eval/sweep --unsafe-exec`)"),
])
def test_a_training_config_grants_no_privilege(trap, task, params, needle):  # noqa: F811
    """``dlm train CONFIG`` built its eval tasks from ``task_params`` as given: ``allow_import: true``
    made lm-eval import the folder's ``utils.py`` while the config was read, ``unsafe_exec: true``
    ran generated code without bubblewrap. Both are refused, in one line, before anything imports."""
    from dlm_toolkit.training.config import load_train_config

    folder, marker = trap
    args = {k: v.format(folder=folder) if isinstance(v, str) else v for k, v in params.items()}
    with pytest.raises(ConfigError) as err:
        load_train_config({"tasks": {task: 1.0}, "task_params": {task: args}})
    assert needle in str(err.value) and "\n" not in str(err.value), err.value
    assert not marker.exists()


def test_a_training_config_still_sets_task_options():
    """Near miss: an option that is no privilege still reaches the task."""
    from dlm_toolkit.training.config import load_train_config

    config = load_train_config({"tasks": {"add": 1.0}, "task_params": {"add": {"max_digits": 2}}})
    assert config.task("add").max_digits == 2


# --------------------------------------------------------------------------------------------- json_depth
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


def old_json_depth(text: str) -> int:
    """The definition json_depth had (a regex over strings, a Python list per bracket): the reference."""
    return max(accumulate(1 if c in "[{" else -1 for c in _BRACKET.findall(_STRING.sub('""', text))), default=0)


def random_json(rng: random.Random, depth: int) -> object:
    """Nested lists and objects whose strings hold brackets, quotes, backslashes and non-ASCII text."""
    pieces = ['[', ']', '{', '}', '"', '\\', '\\"', '\\\\', 'a', 'é', '\n', '\u2028', ' ']
    word = "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))
    if depth == 0 or rng.random() < 0.25:
        return rng.choice([word, rng.randrange(-9, 99), None, True, 1.5])
    kids = [random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return kids if rng.random() < 0.5 else {f"{word}{i}": kid for i, kid in enumerate(kids)}


@pytest.mark.parametrize("scale", ["small", "large (numpy path)"])
def test_json_depth_matches_the_old_definition(scale):
    rng = random.Random(42)
    for trial in range(150 if scale == "small" else 3):
        value = random_json(rng, rng.randrange(12))
        if scale != "small":  # past 2^16 brackets and quotes
            value = [value, [random_json(rng, 8) for _ in range(3000)]]
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert json_depth(text) == old_json_depth(text), (trial, text[:200])


@pytest.mark.parametrize("text,depth", [
    ("", 0), ("1", 0), ("[]", 1), ('[["]"]]', 2), ('["\\"]", [1]]', 2), ('["\\\\", [1]]', 2),
    ('["\\\\\\"[[[", []]', 2), ('{"a": [{"b": "}}}"}]}', 3), ('"[[[["', 0), ("[" * 65 + "]" * 65, 65),
])
def test_json_depth_by_hand(text, depth):
    """Escaped quotes (odd backslashes) stay inside a string, an even run closes it."""
    assert json_depth(text) == depth == old_json_depth(text)
    big = "[" + ", ".join([text or "0"] * 40_000) + "]"  # the same text through the numpy path
    assert json_depth(big) == depth + 1


# ----------------------------------------------------------------------------------- one sandbox probe


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid pool exists only for an evaluator running as root")
def test_the_probe_is_shared_and_a_busy_pool_is_said_and_not_remembered(small_pool):  # noqa: F811
    """A task probed with ``sandbox_info()`` and its runner with ``sandbox_info(sys.executable)``: two
    probes, and if every pool uid was leased at the runner's, a refusal saying bubblewrap is not
    usable -- and that answer was cached for the process's life."""
    from dlm_toolkit.tasks.sandbox import SandboxUnavailable, check_isolation, limits, sandbox_info

    sandbox_info.cache_clear()
    try:
        assert sandbox_info() is sandbox_info(sys.executable)
        sandbox_info.cache_clear()
        with limits.uid_lease(), limits.uid_lease(), limits.uid_lease():  # the whole (test) pool
            busy = sandbox_info(sys.executable)
            with pytest.raises(SandboxUnavailable) as err:
                check_isolation(info=busy)
        line = str(err.value)
        assert "no sandbox uid could be leased" in line and "all 3 sandbox uids" in line, line
        assert "not usable" not in line and "\n" not in line
        assert sandbox_info(sys.executable).bwrap is not None  # the busy answer was not kept
        assert sandbox_info() is sandbox_info(sys.executable)
    finally:
        sandbox_info.cache_clear()


# ------------------------------------------------------------------- options of the generated tasks
GSM_PLUS = "tests/fixtures/benchmarks/gsm_plus/gsmplus_testmini.jsonl"


@pytest.mark.parametrize("task,option,bad,near_miss,needle", [
    ("add", "max_digits", 10**18, 1000, "an integer in [1, 1000]"),  # 10^18 digits: `dlm eval` never ended
    ("add", "max_digits", 1001, 1, "an integer in [1, 1000]"),
    ("add", "max_digits", True, 2, "an integer in [1, 1000] (got True)"),
    ("add", "max_digits", 2.5, 3, "(got 2.5)"),
    ("add", "max_digits", float("inf"), 5, "(got inf)"),
    ("sort", "max_len", 10**8, 1000, "an integer in [1, 1000]"),  # a list of 10^8 numbers: never ended
    ("sort", "min_len", 2.5, 8, "min_len: must be an integer"),
    ("sort", "min_len", True, 1, "min_len: must be an integer"),
    ("either", "max_len", 10**18, 1000, "max_len: must be an integer in [2, 1000]"),
    ("either", "min_len", 2.5, 2, "min_len: must be an integer"),
    ("either", "differ", 1e-9, 0.01, "differ: must be a number in [0.01, 1]"),  # redrew for ever
    ("either", "differ", True, 1, "differ: must be a number"),
    ("either", "marked", "no", False, "marked: must be true or false (got 'no')"),  # "no" was read as true
    ("either", "marked", 0, True, "marked: must be true or false"),
    ("pick", "max_chunk", 10**18, 100, "max_chunk: must be an integer in [1, 100]"),
    ("pick", "max_chunks", float("inf"), 7, "max_chunks: must be an integer"),
    ("pick", "min_chunks", True, 1, "min_chunks: must be an integer"),
    ("pick", "differ", 1e-300, 0.4, "differ: must be a number in [0.01, 1]"),
    ("tiesort", "digits", True, 1, "digits: must be an integer in [1, 9]"),
    ("tiesort", "min_len", 2.5, 9, "min_len: must be an integer in [2, 26]"),
    ("sudoku", "clues", 40.0, 40, "clues: must be an integer in [24, 81]"),
    ("gsm_plus", "critical_thinking", "false", True, "critical_thinking: must be true or false"),
])
def test_generated_task_options_have_a_type_and_a_range(task, option, bad, near_miss, needle):
    """Every option is checked when the task is built, one line naming it; the near miss builds."""
    from dlm_toolkit.tasks import get_task

    base = {"data": GSM_PLUS} if task == "gsm_plus" else {}
    with pytest.raises(ConfigError) as err:
        get_task(task, **base, **{option: bad})
    line = str(err.value)
    assert f"task '{task}': {option}: must be" in line and needle in line and "\n" not in line, line
    built = get_task(task, **base, **{option: near_miss})
    assert getattr(built, option) == near_miss
    if task in ("add", "sort", "either", "pick"):
        assert built.instances(2, 0, "eval")  # and it makes instances


# -------------------------------------------------------------- LiveCodeBench: what the candidate sees
YES_NO = [(n, "Yes" if n % 3 == 0 else "No") for n in range(1, 9)]


@pytest.fixture(scope="module")
def yes_no(tmp_path_factory):
    """A stdin problem whose answers are Yes or No (AtCoder has many), one public test, seven private."""
    from test_livecodebench_hostile import _rows, _write, stdin_test

    from dlm_toolkit.tasks import get_task

    row = _rows()[0]
    cases = [stdin_test(f"{n}\n", f"{answer}\n") for n, answer in YES_NO]
    row["public_test_cases"], row["private_test_cases"] = json.dumps(cases[:1]), json.dumps(cases[1:])
    task = get_task("livecodebench", data=str(_write(tmp_path_factory.mktemp("lcb") / "t.jsonl", [row])),
                    timeout_s=2)
    return task, task.instances(task.eval_size, 0, "eval")[0]


@pytest.mark.parametrize("code,passes", [
    # the output cap was 2 * len(expected) + 64 Ki, handed to the candidate: "Yes\n" vs "No\n" read off it
    ("import sys\nprint('Yes' if sys.stdout.left == 2 * 4 + 65536 else 'No')", False),
    ("import sys\nf = sys._getframe()\nwhile 'max_output' not in f.f_locals:\n    f = f.f_back\n"
     "print('Yes' if f.f_locals['max_output'] == 2 * 4 + 65536 else 'No')", False),
    ("import sys\nprint('x' * (2 * 4 + 65537))", False),  # the flood rule, now on the test side
    ("print('Yes' if int(input()) % 3 == 0 else 'No')", True),  # near miss: the honest answer
])
def test_the_candidate_learns_nothing_of_the_expected_output(yes_no, code, passes):
    task, problem = yes_no
    result = task.run(problem, f"```python\n{code}\n```")
    assert result.passed is passes, result.reason
    if not passes:
        assert "test 0: flood" in result.reason if "'x'" in code else "wrong answer" in result.reason


@pytest.mark.parametrize("line,bad", [
    ("1" * 4301, True),  # past Python's int-string limit: a ValueError traceback out of the task's build
    ("1" * 4300, False),
    ("NaN", True),  # never equal to anything, and the sandbox boundary refuses it: an unsolvable test
    ("1e999", True),  # inf
    ("1e308", False),
    ("-Infinity", True),
])
def test_a_call_based_test_line_is_finite_json_or_one_line(tmp_path, line, bad):
    from test_livecodebench_hostile import _rows, _write

    from dlm_toolkit.tasks import get_task
    from dlm_toolkit.tasks.data import DataError

    row = _rows()[2]  # lc3000, call-based
    row["public_test_cases"] = json.dumps([{"input": "[1]\n0", "output": line, "testtype": "functional"}])
    row["private_test_cases"] = "[]"
    path = _write(tmp_path / "t.jsonl", [row])
    if not bad:
        assert get_task("livecodebench", data=str(path)).eval_size == 1
        return
    with pytest.raises(DataError) as err:
        get_task("livecodebench", data=str(path))
    text = str(err.value)
    assert f"{path}:1: question 'lc3000': field 'public_test_cases': test 0 of a call-based problem" in text, text
    assert "\n" not in text


# ---------------------------------------------------------------- restricted pickle: colliding keys
def colliding_dict(n: int) -> bytes:
    """A protocol-2 dict of ``n`` integer keys ``k * (2^61 - 1)``: all hash to 0, so each insertion
    probes every earlier key (49,000 of them, 636 kB, loaded in 10 s)."""
    import pickle

    body = b"".join(pickle.dumps(k * ((1 << 61) - 1), protocol=2)[2:-1] + b"N" for k in range(1, n + 1))
    return b"\x80\x02}(" + body + b"u."


def items_dict(n: int) -> dict:
    """``n`` dict items in all, three of them in nested dicts, no shared object (no memo read)."""
    d: dict = {str(i): [i, {f"x{i}": (i, i + 1)}] if i < 3 else i for i in range(n - 6)}
    d["a"] = {"b": 1, "c": 2}
    return d


@pytest.mark.parametrize("protocol", range(6))
def test_the_dict_item_bound_is_exact_at_every_protocol(protocol):
    import pickle

    from dlm_toolkit.tasks.safe_pickle import MAX_DICT_ITEMS, UnsafeBlob, load_plain

    assert load_plain(pickle.dumps(items_dict(MAX_DICT_ITEMS), protocol=protocol)) == items_dict(MAX_DICT_ITEMS)
    with pytest.raises(UnsafeBlob, match=f"more than {MAX_DICT_ITEMS} dict items"):
        load_plain(pickle.dumps(items_dict(MAX_DICT_ITEMS + 1), protocol=protocol))


def test_colliding_keys_are_refused_before_the_quadratic_load():
    import time

    from dlm_toolkit.tasks.safe_pickle import MAX_DICT_ITEMS, UnsafeBlob, load_plain

    assert len(load_plain(colliding_dict(MAX_DICT_ITEMS))) == MAX_DICT_ITEMS  # milliseconds
    start = time.process_time()
    with pytest.raises(UnsafeBlob, match="dict items"):
        load_plain(colliding_dict(49_000))
    assert time.process_time() - start < 2.0  # a guard only: the load took 10 s of CPU
