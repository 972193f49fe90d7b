"""Benchmark tasks from local data: the verifiers against the reference harnesses' own decisions,
the data-file errors, and the code benchmarks' verdicts through ``tasks.code.check_solution``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dlm_toolkit.cli import main
from dlm_toolkit.tasks import get_task
from dlm_toolkit.tasks.code import check_solution, extract_code, output_tests, run_outputs
from dlm_toolkit.tasks.data import DATA_ENV, DataError
from dlm_toolkit.tasks.gsm8k import extract_answer, gsm8k_match
from dlm_toolkit.tasks.math500 import is_equiv, last_boxed

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "benchmarks"
TESTBED = str(Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-editable")
FOLDER = {"gsm8k": "gsm8k", "gsm_plus": "gsm_plus", "math500": "math500", "mbpp": "mbpp",
          "humaneval_plus": "evalplus", "mbpp_plus": "evalplus"}

# model-style outputs for a GSM8K problem whose answer is 1,003 (reference: the full solution)
GSM_REFERENCE = "Eli buys 9027 / 9 = <<9027/9=1003>>1,003 apples.\n#### 1,003"
GSM_OUTPUTS = {  # output -> (strict, flexible) as a person reads lm-eval's rules
    "9027 / 9 = 1003.\n#### 1003": (True, True),
    "So the answer is 1,003.\n#### 1,003": (True, True),
    "#### $1003": (False, True),  # strict's pattern has no '$'; flexible keeps '$', then ignored
    "The answer is 1003.": (False, True),
    "He buys 1003 apples, which costs $9027.": (False, False),  # flexible takes the LAST number
    "#### 1003\nQuestion: next one 5": (True, False),  # strict takes the FIRST '#### N'
    "#### 1002": (False, False),
    "I do not know.": (False, False),
    "": (False, False),
    "@@@ ### 1003!!": (False, True),
    "#### -1003": (False, False),
    "1003.0": (False, False),  # exact match: '1003.0' is not '1003'
    "#### 1003\nAgain: #### 1002": (True, False),  # two '#### N': strict takes the FIRST (lm-eval's group 0)
    "#### 1002\nAgain: #### 1003": (False, True),  # ... and flexible the last number
}


def test_gsm8k_verifier_matches_lm_eval_filters_and_metric():
    """Our strict/flexible decisions equal lm-eval's own RegexFilter + exact_match on every output."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    strict = RegexFilter(regex_pattern=r"#### (\-?[0-9\.\,]+)")
    flexible = RegexFilter(regex_pattern=r"(-?[$0-9.,]{2,})|(-?[0-9]+)", group_select=-1)
    ignore = [",", "\\$", "(?s).*#### ", "\\.$"]
    for output, expected in GSM_OUTPUTS.items():
        for which, filt, want in (("strict", strict, expected[0]), ("flexible", flexible, expected[1])):
            extracted = filt.apply([[output]], [{}])[0][0]
            assert extract_answer(output, which) == extracted, (output, which)
            reference = exact_match_hf_evaluate([extracted], [GSM_REFERENCE], regexes_to_ignore=ignore,
                                                ignore_case=True)["exact_match"] == 1.0
            reference = bool(reference)
            assert gsm8k_match(output, GSM_REFERENCE, which) is reference is want, (output, which)


MATH_TABLE = [  # (model output, reference answer, correct?)
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", True),
    ("$\\boxed{\\dfrac12}$", "\\frac{1}{2}", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{1/2}", "\\frac{1}{2}", True),
    ("first \\boxed{3} then corrected: \\boxed{4}", "4", True),
    ("first \\boxed{4} then \\boxed{3}", "4", False),
    ("\\boxed{x = 4}", "4", True),
    ("\\boxed{60^\\circ}", "60^\\circ", True),
    ("\\boxed{60}", "60^\\circ", True),
    ("\\boxed{25\\%}", "25\\%", True),
    ("\\boxed{200}", "200 \\text{ cm}", True),
    ("\\boxed{\\left( 3, 2 \\right)}", "(3,2)", True),
    ("\\boxed{2\\sqrt2}", "2\\sqrt{2}", True),
    ("\\boxed{5}", "4", False),
    ("The answer is 4.", "4", False),  # no box, no answer
    ("\\boxed{4", "4", False),  # unclosed
    ("", "4", False),
    ("\\fbox{7}", "7", True),
    ("\\boxed{-5}", "5", False),  # the sign is part of the answer
    ("\\boxed{5}", "-5", False),
    ("\\boxed{-5}", "-5", True),
    ("\\boxed{-\\frac{1}{2}}", "\\frac{1}{2}", False),
    ("\\boxed{-0.5}", "-\\frac{1}{2}", False),  # the reference's normal form only rewrites a bare 0.5
]


def test_math_verifier_matches_the_hendrycks_reference():
    """Our boxed extraction + equivalence decide every row as lm-eval's transcription of Hendrycks'
    MATH grader does (last_boxed_only_string, remove_boxed, is_equiv), and as the table says."""
    from lm_eval.tasks.hendrycks_math import utils as ref

    for output, reference, want in MATH_TABLE:
        assert is_equiv(last_boxed(output), reference) is want, (output, reference)
        boxed = ref.last_boxed_only_string(output)
        if boxed is not None and boxed.startswith("\\fbox"):
            continue  # the reference finds \fbox but its remove_boxed only strips \boxed (it raises)
        theirs = False if boxed is None else bool(ref.is_equiv(ref.remove_boxed(boxed), reference))
        assert theirs is want, ("reference harness", output, reference)


def test_last_boxed_takes_the_last_balanced_box():
    assert last_boxed("\\boxed{a} x \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\{1,2\\}}") is not None
    assert last_boxed("no box") is None


def test_missing_data_is_one_line_naming_task_path_and_fetch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    with pytest.raises(DataError) as err:
        get_task("gsm8k")
    msg = str(err.value)
    assert "gsm8k" in msg and str(tmp_path / "gsm8k" / "test.jsonl") in msg and "curl" in msg and "\n" not in msg
    for name in FOLDER:
        with pytest.raises(DataError, match=name):
            get_task(name)
    out_dir = tmp_path / "out"
    code = main(["eval", "--checkpoint", TESTBED, "--task", "mbpp", "--n", "2", "--json",
                 "--data", str(tmp_path / "nowhere.json")])
    err_text = capsys.readouterr().err
    assert code == 2 and err_text.count("\n") == 1 and "nowhere.json" in err_text and "curl" in err_text
    assert not out_dir.exists()


def test_env_dir_and_data_folder_are_read(tmp_path, monkeypatch):
    shutil.copytree(FIXTURES / "gsm8k", tmp_path / "gsm8k")
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert len(get_task("gsm8k").instances(100, 0, "eval")) == 30
    monkeypatch.delenv(DATA_ENV)
    assert get_task("gsm8k", data=str(tmp_path / "gsm8k")).eval_size == 30  # a folder: the official file name in it


@pytest.mark.parametrize("content, where", [
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q"\n', ":2:"),
    ('{"question": "q", "answer": "#### 1"}\n\n{"question": "q2"}\n', ":3: missing field(s) 'answer'"),
    ('[1, 2]\n', ":1: expected a JSON object"),
    ('{"question": "q", "answer": "no final answer"}\n', "record 0: 'answer' has no '#### N'"),
])
def test_malformed_data_names_the_line(tmp_path, content, where):
    path = tmp_path / "test.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        get_task("gsm8k", data=str(path))
    assert where in str(err.value) and str(path) in str(err.value)


def test_mbpp_record_missing_tests_is_named(tmp_path):
    records = json.loads((FIXTURES / "mbpp" / "sanitized-mbpp.json").read_text())
    del records[2]["test_list"]
    (tmp_path / "sanitized-mbpp.json").write_text(json.dumps(records))
    with pytest.raises(DataError, match=r"record 2: missing field\(s\) 'test_list'"):
        get_task("mbpp", data=str(tmp_path))


def test_subsets_are_seeded_and_in_file_order():
    task = get_task("gsm8k", data=str(FIXTURES / "gsm8k"))
    a, b = task.instances(5, 1, "eval"), task.instances(5, 1, "eval")
    assert a == b and a != task.instances(5, 2, "eval")
    order = [i.meta["index"] for i in a]
    assert order == sorted(order)
    with pytest.raises(ValueError):
        task.instances(3, 0, "train")


def test_gsm_plus_leaves_out_critical_thinking_unless_asked():
    assert get_task("gsm_plus", data=str(FIXTURES / "gsm_plus")).eval_size == 10
    assert get_task("gsm_plus", data=str(FIXTURES / "gsm_plus"), critical_thinking=True).eval_size == 11


def test_mbpp_reads_the_test_split_and_its_entry_points():
    task = get_task("mbpp", data=str(FIXTURES / "mbpp"))
    insts = task.instances(100, 0, "eval")
    assert len(insts) == 8 and all(11 <= i.meta["task_id"] <= 510 for i in insts)
    assert [i.meta["entry_point"] for i in insts][:3] == ["add_two", "reverse_words", "count_vowels"]
    assert insts[0].prompt.endswith("[BEGIN]\n") and "[DONE]" in task.stop


def test_check_solution_verdicts():
    tests = "assert add_two(1, 2) == 3\nassert add_two(-1, 1) == 0\n"
    kw = dict(timeout_s=10.0, memory_mb=512, unsafe_exec=True)
    assert check_solution("def add_two(a, b):\n    return a + b\n", tests, "add_two", **kw).passed
    assert not check_solution("def add_two(a, b):\n    return a - b\n", tests, "add_two", **kw).passed
    assert not check_solution("def add_two(a, b):\n    raise ValueError\n", tests, "add_two", **kw).passed
    assert not check_solution("import sys\nsys.exit(0)\ndef add_two(a, b):\n    return 0\n", tests, "add_two", **kw).passed
    with pytest.raises(ValueError):
        check_solution("", tests, "not a name", **kw)


def test_output_tests_compare_exactly_or_within_atol():
    kw = dict(timeout_s=10.0, memory_mb=512, unsafe_exec=True)
    reference = "def mean(xs):\n    return sum(xs) / len(xs)\n"
    inputs = [[[1, 2]], [[0.1, 0.2]], [[3]]]
    expected = run_outputs(reference, "mean", inputs, **kw)
    assert expected == ["1.5", "0.15000000000000002", "3.0"]
    tests = output_tests("mean", inputs, expected, atol=0.0)
    assert check_solution(reference, tests, "mean", **kw).passed
    close = "def mean(xs):\n    return sum(xs) / len(xs) + 5e-7\n"  # within the 1e-6 float default (atol 0 given)
    assert check_solution(close, tests, "mean", **kw).passed
    off = "def mean(xs):\n    return sum(xs) / len(xs) + 1e-3\n"
    assert not check_solution(off, tests, "mean", **kw).passed
    ints = output_tests("mean", [[[1, 2]]], ["1"], atol=0.0)  # expected an int: exact only
    assert not check_solution(reference, ints, "mean", **kw).passed


FLOAT_TABLE = [  # (output, expected, atol given, equal?) as EvalPlus decides: exact, else for a float or a
    # list/tuple of floats: same type, same length, every element within atol (1e-6 if 0) + 1e-7 * |e|
    (1.0, 1.0, 0.0, True),
    (1.0000005, 1.0, 0.0, True),
    (1.001, 1.0, 0.0, False),
    (1.001, 1.0, 0.01, True),
    ([1.0, 2.0000005], [1.0, 2.0], 0.0, True),
    ([1.0], [1.0, 2.0], 0.0, False),  # truncated: zip would compare one pair and accept it
    ([1.0, 2.0, 3.0], [1.0, 2.0], 0.0, False),  # too long
    ([], [1.0], 0.0, False),
    ((1.0, 2.0), [1.0, 2.0], 0.0, False),  # a tuple for a list
    ([1.0, 2.1], [1.0, 2.0], 0.0, False),
    ([1, 2], [1.0, 2.0], 0.0, True),  # equal as Python compares them (exact)
    ("1.0", 1.0, 0.0, False),
    (None, 1.0, 0.0, False),
    (1, 2, 0.0, False),  # ints: exact only
]


@pytest.mark.parametrize("out, exp, atol, want", FLOAT_TABLE)
def test_the_evalplus_float_comparison_table(out, exp, atol, want):
    from dlm_toolkit.tasks import code

    namespace: dict = {}
    exec(code._COMPARE, namespace)  # the comparison the generated tests run inside the sandbox
    assert namespace["_dlm_close"](out, exp, atol) is want


def test_run_outputs_splits_outputs_too_large_for_one_run():
    kw = dict(timeout_s=20.0, memory_mb=512, unsafe_exec=True)
    reference = "import random\ndef noise(k):\n    r = random.Random(k)\n    return [r.random() for _ in range(120)]\n"
    inputs = [[k] for k in range(12)]  # ~30 kB of reprs: more than one stdout tail holds
    outputs = run_outputs(reference, "noise", inputs, **kw)
    import random

    def noise(k: int) -> list[float]:
        r = random.Random(k)
        return [r.random() for _ in range(120)]

    assert [eval(o) for o in outputs] == [noise(k) for k in range(12)]


def test_extract_code_takes_the_first_fenced_block():
    assert extract_code("Here:\n```python\ndef f():\n    return 1\n```\nmore ```python\nx\n```") == "def f():\n    return 1\n"
    assert extract_code("```\nprint(1)\n") == "print(1)\n"
    assert extract_code("def g(): pass") == "def g(): pass"


@pytest.mark.parametrize("name", ["mbpp", "humaneval_plus", "mbpp_plus"])
def test_code_benchmarks_pass_the_reference_and_fail_a_wrong_answer(name):
    task = get_task(name, data=str(FIXTURES / FOLDER[name]), unsafe_exec=True)
    insts = task.instances(3, 0, "eval")
    right = [i.reference if name == "humaneval_plus" else f"```python\n{i.reference}```" for i in insts]
    wrong = ["    return None\n" if name == "humaneval_plus" else "```python\ndef nothing():\n    pass\n```" for _ in insts]
    assert task.score_batch(insts, right) == [1.0, 1.0, 1.0]
    assert task.score_batch(insts, wrong) == [0.0, 0.0, 0.0]


def test_humaneval_plus_chat_answer_with_the_whole_function(tmp_path):
    row = json.loads((FIXTURES / "evalplus" / "HumanEvalPlus.jsonl").read_text().splitlines()[0])
    row["prompt"] = "def add_two(a, b):\n"  # a bare signature: prompt + a whole function would not parse
    (tmp_path / "HumanEvalPlus.jsonl").write_text(json.dumps(row) + "\n")
    task = get_task("humaneval_plus", data=str(tmp_path), unsafe_exec=True)
    inst = task.instances(1, 0, "eval")[0]
    assert inst.meta["entry_point"] == "add_two"
    assert task.score(inst, "Sure:\n```python\ndef add_two(a, b):\n    return b + a\n```") == 1.0
    assert task.score(inst, "Sure:\n```python\ndef add_two(a, b):\n    return a * b\n```") == 0.0
    assert task.score(inst, "    return a + b\n") == 1.0  # completion style: the body after the prompt


def test_plus_inputs_catch_what_base_inputs_miss(tmp_path):
    rows = [json.loads(line) for line in (FIXTURES / "evalplus" / "MbppPlus.jsonl").read_text().splitlines()]
    row = rows[0]  # add_two
    row["plus_input"] = [[10**6, 1]]
    (tmp_path / "MbppPlus.jsonl").write_text(json.dumps(row) + "\n")
    cheat = "```python\ndef add_two(a, b):\n    return {(1, 2): 3, (5, 7): 12, (-1, 1): 0}[(a, b)]\n```"
    base = get_task("mbpp_plus", data=str(tmp_path), unsafe_exec=True, plus=False)
    plus = get_task("mbpp_plus", data=str(tmp_path), unsafe_exec=True)
    inst = plus.instances(1, 0, "eval")[0]
    assert base.score(inst, cheat) == 1.0 and plus.score(inst, cheat) == 0.0


def test_task_options_a_task_lacks_are_one_line(capsys):
    assert main(["eval", "--checkpoint", TESTBED, "--task", "lm_eval", "--n", "2"]) == 2
    err = capsys.readouterr().err
    assert "task 'lm_eval'" in err and "'task'" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="its options: data, answer_length, match"):
        get_task("gsm8k", data=str(FIXTURES / "gsm8k"), colour="red")
