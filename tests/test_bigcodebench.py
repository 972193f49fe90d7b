"""BigCodeBench: data and subsets, the official prompts and program assembly, grading by each task's unittest
module in the sandbox (canonical solutions pass, near-misses fail, with the failing tests named), hangs,
floods, early exits, forged reports, test modules that do not load, env_missing, and the README command
on the testbed. Fixtures: tests/fixtures/bigcodebench (official format, written by make_fixtures.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_reproduce import chat_testbed  # noqa: F401 -- the testbed with a chat template (a fixture)

from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.tasks import DataError, get_task
from dlm_toolkit.tasks.bigcodebench import INSTRUCTION_PREFIX, RESPONSE_PREFIX, BigCodeBenchTask
from dlm_toolkit.tasks.sandbox import SandboxUnavailable, sandbox_info
from dlm_toolkit.tasks.unittest_box import probe_modules, run_unittest, top_level_imports

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "bigcodebench"

if sandbox_info().bwrap is None:  # the test-deps script installs bubblewrap; the grading is its point
    pytest.skip(f"bubblewrap is not usable here: {sandbox_info().bwrap_problem}", allow_module_level=True)


@pytest.fixture(scope="module")
def task() -> BigCodeBenchTask:
    return get_task("bigcodebench", data=str(FIX), timeout_s=30)


@pytest.fixture(scope="module")
def by_id(task):
    return {i.meta["task_id"]: i for i in task.instances(10, 0, "eval")}


# ----------------------------------------------------------------------------- data, subsets, env_missing
def test_the_set_leaves_out_the_task_whose_library_is_missing_and_says_so(task, by_id, capsys):
    assert sorted(by_id) == ["BigCodeBench/0", "BigCodeBench/1"]  # numpy is found: /1 stays
    assert task.eval_size == 2
    assert task.env_missing == {"BigCodeBench/2": ["dlm_fixture_absent_library"]}
    report = task.env_report()
    assert report.startswith("env_missing: 1 task(s) left out") and "dlm_fixture_absent_library (1)" in report
    with pytest.raises(ConfigError, match=r"env_missing: 1 task\(s\).*dlm_fixture_absent_library"):
        get_task("bigcodebench", data=str(FIX), on_env_missing="error")


def test_top_level_imports():
    src = "import a.b, c as cc\nfrom d.e import f\nfrom . import g\nfrom .h import i\nfrom __future__ import annotations\n"
    assert top_level_imports(src, "def f():\n    import k\n", "not python (") == {"a", "c", "d", "k"}


def test_the_sandbox_finds_the_environments_libraries_and_nothing_else():
    assert probe_modules(["numpy", "json", "dlm_fixture_absent_library"]) == {
        "numpy": True, "json": True, "dlm_fixture_absent_library": False}


def test_hard_subset_from_an_id_file_a_jsonl_file_or_a_field(tmp_path):
    ids = get_task("bigcodebench", data=str(FIX), subset="hard", hard_ids=str(FIX / "hard_ids.txt"))
    assert [i.meta["task_id"] for i in ids.instances(5, 0, "eval")] == ["BigCodeBench/1"]
    (tmp_path / "hard.jsonl").write_text(json.dumps({"task_id": "BigCodeBench/0", "other": 1}) + "\n")
    jsonl = get_task("bigcodebench", data=str(FIX), subset="hard", hard_ids=str(tmp_path / "hard.jsonl"))
    assert [i.meta["task_id"] for i in jsonl.instances(5, 0, "eval")] == ["BigCodeBench/0"]
    records = [json.loads(line) for line in (FIX / "BigCodeBench.jsonl").read_text().splitlines()]
    records[0]["hard"] = True
    records[1]["hard"] = False
    (tmp_path / "flagged.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    field = get_task("bigcodebench", data=str(tmp_path / "flagged.jsonl"), subset="hard")
    assert [i.meta["task_id"] for i in field.instances(5, 0, "eval")] == ["BigCodeBench/0"]
    with pytest.raises(DataError, match="subset 'hard' needs hard_ids"):
        get_task("bigcodebench", data=str(FIX), subset="hard")
    with pytest.raises(DataError, match="hard_ids: no file at"):
        get_task("bigcodebench", data=str(FIX), subset="hard", hard_ids=str(tmp_path / "none.txt"))


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("test"), r"bad.jsonl:1: missing field\(s\) 'test'"),
    (lambda r: r.update(code_prompt=3), r"bad.jsonl:1: field 'code_prompt': Input should be a valid string \(got int 3\)"),
    (lambda r: r.update(entry_point="task func"), r"bad.jsonl:1: 'entry_point' 'task func' is not a Python name"),
    (lambda r: r.update(hard="yes"), r"bad.jsonl:1: field 'hard': Input should be a valid boolean \(got str 'yes'\)"),
])
def test_malformed_records_are_one_line_naming_the_record_and_field(tmp_path, change, message):
    record = json.loads((FIX / "BigCodeBench.jsonl").read_text().splitlines()[0])
    change(record)
    (tmp_path / "bad.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=message):
        get_task("bigcodebench", data=str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize("kwargs, message", [
    ({"split": "train"}, "split: must be one of complete, instruct"),
    ({"subset": "easy"}, "subset: must be one of full, hard"),
    ({"on_env_missing": "ignore"}, "on_env_missing: must be 'skip' or 'error'"),
    ({"timeout_s": 0}, "timeout_s: must be a number > 0"),
    ({"python": "/nowhere/python"}, "python: no interpreter at /nowhere/python"),
])
def test_bad_options(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        get_task("bigcodebench", data=str(FIX), **kwargs)


# ----------------------------------------------------------------------------- prompts and programs
def test_official_prompts_and_stop_strings(task, by_id):
    inst = by_id["BigCodeBench/1"]
    record = json.loads((FIX / "BigCodeBench.jsonl").read_text().splitlines()[1])
    assert inst.prompt == record["complete_prompt"]
    assert task.user_message(inst) == f"{INSTRUCTION_PREFIX}\n```\n{record['complete_prompt'].strip()}\n```\n"
    assert "\ndef " in task.stop and "\nprint(" in task.stop
    instruct = get_task("bigcodebench", data=str(FIX), split="instruct")
    iinst = next(i for i in instruct.instances(5, 0, "eval") if i.meta["task_id"] == "BigCodeBench/1")
    body = f"{INSTRUCTION_PREFIX}\n{record['instruct_prompt'].strip()}\n"
    assert instruct.user_message(iinst) == body
    assert iinst.prompt == f"{body}{RESPONSE_PREFIX}\n```python\n"
    assert "\ndef " not in instruct.stop and "\nprint(" in instruct.stop  # direct-completion stops: complete only
    assert "\n```" in instruct.stop and "\n```" not in task.stop


def test_program_assembly(task, by_id):
    inst = by_id["BigCodeBench/1"]
    body = "    return 1\n"
    assert task.program(inst, body) == inst.meta["complete_prompt"] + body  # raw: prompt + completion
    whole = "import numpy as np\ndef task_func(rows, cols, seed=0):\n    return 2\n"
    assert task.program(inst, f"Here:\n```python\n{whole}```\nDone.") == whole  # a fenced whole function
    assert task.program(inst, f"```python\n{body}```") == inst.meta["code_prompt"] + body  # a fenced body only
    assert task.program(inst, whole) == whole  # an unfenced whole function
    # after the raw instruct prompt's open fence: the code up to the closing fence
    assert task.program(inst, whole + "```\nThis draws and standardises.") == whole


# ----------------------------------------------------------------------------- grading
NEAR_MISSES = {
    "BigCodeBench/0": [
        ("    return sorted(os.listdir(directory))\n", {"test_filters_and_sorts", "test_no_match", "test_real_directory"}),
        ("    regex = re.compile(pattern)\n    return sorted(n for n in os.listdir(directory) if regex.match(n))\n",
         {"test_filters_and_sorts"}),  # match, not fullmatch: 'a.txt.bak' slips in
    ],
    "BigCodeBench/1": [
        ("    data = np.random.default_rng(seed).standard_normal((rows, cols))\n"
         "    return (data - data.mean(axis=0)) / data.std(axis=0, ddof=1)\n", {"test_standardised", "test_seeded"}),
        ("    data = np.random.default_rng(0).standard_normal((rows, cols))\n"
         "    return (data - data.mean(axis=0)) / data.std(axis=0)\n", {"test_seeded"}),  # ignores the seed
    ],
}


@pytest.mark.parametrize("task_id", sorted(NEAR_MISSES))
def test_canonical_solution_passes_and_near_misses_fail_naming_the_tests(task, by_id, task_id):
    inst = by_id[task_id]
    ok = task.run_program(inst, task.reference_program(inst))
    assert ok.passed and ok.reason == "" and ok.tests_run == 3 and ok.failed == {}
    assert task.score(inst, inst.reference) == 1.0
    for completion, failing in NEAR_MISSES[task_id]:
        result = task.run(inst, completion)
        assert not result.passed and task.score(inst, completion) == 0.0
        assert set(result.failed) == failing and result.tests_run == 3
        assert result.reason.startswith("failed: " + ", ".join(sorted(failing)))


def test_the_tests_patch_what_the_candidate_calls_in_the_same_process(task, by_id):
    """BigCodeBench's tests mock the candidate's imports: with os.listdir patched, a candidate that
    reads the real folder instead (glob) fails exactly the patched tests."""
    inst = by_id["BigCodeBench/0"]
    glob_based = ("    import glob\n    regex = re.compile(pattern)\n"
                  "    return sorted(n for n in (os.path.basename(p) for p in glob.glob(os.path.join(directory, '*')))"
                  " if regex.fullmatch(n))\n")
    result = task.run(inst, glob_based)
    assert set(result.failed) == {"test_filters_and_sorts"}  # test_no_match passes on an empty real folder


@pytest.fixture(scope="module")
def quick(task) -> BigCodeBenchTask:
    return get_task("bigcodebench", data=str(FIX), timeout_s=2)


@pytest.mark.parametrize("completion, reason", [
    ("    while True:\n        pass\n", "timed out after 2 s"),
    ("    while True:\n        print('x' * 10000)\n", "timed out after 2 s"),  # stdout is swallowed, as officially
    ("    while True:\n        os.write(1, b'x' * 65536)\n", "failed: test_filters_and_sorts"),  # the capped file: EFBIG
])
def test_a_hang_or_a_flood_scores_zero_with_the_reason(quick, by_id, completion, reason):
    result = quick.run(by_id["BigCodeBench/0"], completion)
    assert not result.passed and result.reason.startswith(reason)
    assert result.timed_out == reason.startswith("timed out")


@pytest.mark.parametrize("completion, reason", [
    ("    return []\nos._exit(0)\n", "the process ended (exit status 0) before the tests reported"),
    ("    return []\nimport sys\nsys.exit(0)\n", "the test module failed to load: SystemExit: 0"),
    ("    return []\nos.kill(os.getpid(), 9)\n", "the process ended (exit status "),  # -9, or bwrap's 137
    ("    return []\nprint('OK')\nprint('{\"status\": \"pass\", \"tests\": 3, \"failed\": {}, \"reason\": \"\"}')\n",
     "failed: test_filters_and_sorts"),
])
def test_early_exits_and_printed_verdicts_never_pass(quick, by_id, completion, reason):
    result = quick.run(by_id["BigCodeBench/0"], completion)
    assert not result.passed and result.reason.startswith(reason)


def test_a_report_forged_into_every_descriptor_garbles_the_channel_instead_of_passing(quick, by_id):
    forge = ('    return []\nfor _fd in range(3, 1024):\n    try:\n'
             '        os.write(_fd, b\'{"status": "pass", "tests": 3, "failed": {}, "reason": ""}\')\n'
             '    except OSError:\n        pass\n')
    result = quick.run(by_id["BigCodeBench/0"], forge)
    assert not result.passed
    assert result.reason == "more than one report, or a garbled one, reached the report channel"
    assert quick.run(by_id["BigCodeBench/0"], forge.replace("return []", "return sorted(n for n in os.listdir("
                                                             "directory) if re.fullmatch(pattern, n))")).passed is False


def test_a_test_module_that_does_not_load_scores_zero_with_the_reason():
    broken = get_task("bigcodebench", data=str(FIX / "broken.jsonl"), timeout_s=30)
    reasons = {i.meta["task_id"]: broken.run(i, i.reference).reason for i in broken.instances(5, 0, "eval")}
    assert reasons["BigCodeBench/3"].startswith("the program does not compile: SyntaxError")
    assert reasons["BigCodeBench/4"] == "the test module failed to load: KeyError: 5"
    assert run_unittest("def task_func():\n    return 1\n", "import unittest\n", timeout_s=30).reason == (
        "the test module failed to load: NameError: the test module defines no unittest.TestCase named TestCases")


# ----------------------------------------------------------------------------- README command, end to end
def test_readme_command_on_the_testbed(chat_testbed, capsys):
    """README: dlm eval --checkpoint models/LLaDA2.1-mini --task bigcodebench --data data/bigcodebench --chat true ..."""
    tiny = FIX / "tiny.jsonl"
    inst = get_task("bigcodebench", data=str(tiny)).instances(1, 0, "eval")[0]
    assert get_task("bigcodebench", data=str(tiny)).score(inst, inst.reference) == 1.0
    assert main(["eval", "--checkpoint", str(chat_testbed), "--task", "bigcodebench", "--data", str(tiny),
                 "--chat", "true", "--preset", "llada2.1-s", "--n", "1", "--gen-length", "16", "--batch-size", "1",
                 "--json", "--no-progress", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["task"] == "bigcodebench" and out["metric_name"] == "pass@1" and len(out["instances"]) == 1
    assert out["accuracy"] == 0.0 and out["tokens_per_second"] > 0  # the testbed writes no Python
    assert "env_missing: 1 task(s) left out" in captured.err
    assert main(["eval", "--checkpoint", str(chat_testbed), "--task", "bigcodebench", "--data", str(tiny),
                 "--n", "2", "--json", "--no-progress"]) == 2  # 1 runnable task: n=2 is refused, nothing decoded


# ----------------------------------------------------------------------------- the official grader agrees
def test_our_verdicts_match_the_official_graders(task, by_id):
    """bigcodebench 0.2.5's own ``untrusted_check`` (scripts/test.sh installs it without its generation
    dependencies; its grader needs numpy only) on the same programs: the same pass/fail for the canonical
    solutions, a near-miss of each task and an early exit (its harness waits out 241 s on an ``os._exit``:
    not compared)."""
    official = pytest.importorskip("bigcodebench.eval", reason="pip install --no-deps bigcodebench==0.2.5")
    cases = [(tid, by_id[tid].reference) for tid in NEAR_MISSES]
    cases += [(tid, misses[0][0]) for tid, misses in NEAR_MISSES.items()]
    cases += [("BigCodeBench/0", "    return []\nimport sys\nsys.exit(0)\n")]
    ours, theirs = [], []
    for tid, completion in cases:
        inst = by_id[tid]
        program = task.program(inst, completion)
        ours.append(task.run_program(inst, program).passed)
        status, _ = official.untrusted_check(program, inst.meta["test"], inst.meta["entry_point"], 30 * 1024,
                                             30 * 1024, 10, 1, 20)
        theirs.append(status == "pass")
    assert ours == theirs == [True, True] + [False] * (len(cases) - 2)


def test_the_report_pipe_is_held_close_on_exec_out_of_reach_of_child_processes():
    """Before the candidate runs, the harness moves the report pipe to a close-on-exec descriptor (the
    number it was passed as is closed), which a process the candidate starts never holds (even with
    close_fds=False)."""
    tests = (
        "import fcntl, os, stat, subprocess, sys, unittest\n\n\n"
        "class TestCases(unittest.TestCase):\n"
        "    def test_fds(self):\n"
        "        self.assertTrue(stat.S_ISFIFO(os.fstat(900).st_mode))\n"
        "        self.assertTrue(fcntl.fcntl(900, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)\n"
        "        pipe = os.readlink('/proc/self/fd/900')\n"  # the number it was passed as is closed
        "        holders = [fd for fd in os.listdir('/proc/self/fd') if os.path.exists(f'/proc/self/fd/{fd}')\n"
        "                   and os.readlink(f'/proc/self/fd/{fd}') == pipe]\n"
        "        self.assertEqual(holders, ['900'])\n"
        "        child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.listdir(\"/proc/self/fd\")))'],\n"
        "                               capture_output=True, text=True, check=True, close_fds=False).stdout\n"
        "        self.assertNotIn(\"'900'\", child)\n"
        "        self.assertIn(\"'0'\", child)\n")
    result = run_unittest("x = 1\n", tests, timeout_s=30)
    assert result.passed, result.reason


def test_process_mode_grades_the_same(task, by_id):
    """--unsafe-exec without bubblewrap: the same verdicts (no reliability guard: the tasks use tempfile,
    set environment variables and start processes, as the official harness allows)."""
    kwargs = dict(timeout_s=30, unsafe_exec=True, isolation="process")
    first = by_id["BigCodeBench/0"]
    try:
        run_unittest(task.reference_program(first), first.meta["test"], **kwargs)
    except SandboxUnavailable as err:  # the sandbox's own rule where it cannot drop privileges: one line
        assert "process mode" in str(err) and "\n" not in str(err)
        return
    for tid, misses in NEAR_MISSES.items():
        inst = by_id[tid]
        assert run_unittest(task.reference_program(inst), inst.meta["test"], **kwargs).passed
        assert not run_unittest(task.program(inst, misses[0][0]), inst.meta["test"], **kwargs).passed
    with pytest.raises(ConfigError, match="unsafe_exec"):
        run_unittest("x = 1\n", "import unittest\n", isolation="process")


def test_the_paper_experiment_loads_with_its_task_options(tmp_path):
    """experiments/llada2.1-bigcodebench.yaml: every task option it sets is accepted (the task is built
    from them when the experiment loads); the sweep machinery itself: tests/test_reproduce.py."""
    import yaml

    import sweep_helpers as h
    from dlm_toolkit.sweep.experiment import load_experiment

    data = yaml.safe_load((REPO / "experiments" / "llada2.1-bigcodebench.yaml").read_text())
    assert data["task"] == "bigcodebench" and data["task_args"]["timeout_s"] == 240
    assert data["presets_to_enqueue"] == ["llada2.1-s", "llada2.1-q"]
    data.update(model=str(REPO / "checkpoints" / "testbed-editable"))
    data["task_args"] = {**data["task_args"], "data": str(FIX / "tiny.jsonl")}
    exp = load_experiment(h.write_yaml(tmp_path / "exp.yaml", data))
    assert exp.task_args["split"] == "complete" and exp.task_args["answer_length"] == 1280
    data["task_args"]["subset"] = "hard"
    with pytest.raises(ConfigError, match="subset 'hard' needs hard_ids"):
        load_experiment(h.write_yaml(tmp_path / "exp.yaml", data))


def test_a_report_of_many_failing_tests_stays_within_the_pipe():
    tests = ("import unittest\n\n\nclass TestCases(unittest.TestCase):\n    pass\n\n\n"
             "for _i in range(300):\n"
             "    setattr(TestCases, f'test_{_i:03d}_' + 'x' * 150, lambda self: self.fail('y' * 2000))\n")
    result = run_unittest("x = 1\n", tests, timeout_s=30)
    assert not result.passed and result.tests_run == 300 and len(result.failed) == 200
    assert result.reason.startswith("failed: test_000_") and " and 100 more (test_000_" in result.reason
    assert sum(bool(trace) for trace in result.failed.values()) == 20


def test_a_library_folder_under_tmp_is_bound_over_the_sandboxs_own_tmp():
    """A venv under /tmp (a checkout there, as CI may have) stays visible: its read-only bind is
    mounted after the sandbox's /tmp tmpfs, not hidden beneath it. Near miss: without the bind the
    same module is not found."""
    import shutil
    import tempfile

    from dlm_toolkit.tasks.unittest_box import LibraryEnv, library_env

    top = tempfile.mkdtemp(prefix="dlm-libbind-", dir="/tmp")
    try:
        site = os.path.join(top, "site")
        os.makedirs(os.path.join(site, "dlm_probe_pkg"))
        with open(os.path.join(site, "dlm_probe_pkg", "__init__.py"), "w") as f:
            f.write("VALUE = 1\n")
        for folder, dirs, files in os.walk(top):  # readable to the sandbox's leased uid
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        python = library_env().python
        assert probe_modules(["dlm_probe_pkg"], env=LibraryEnv(python=python, binds=(site,))) == {"dlm_probe_pkg": True}
        assert probe_modules(["dlm_probe_pkg"], env=LibraryEnv(python=python, binds=())) == {"dlm_probe_pkg": False}
    finally:
        shutil.rmtree(top)
