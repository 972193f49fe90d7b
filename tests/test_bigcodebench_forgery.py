"""BigCodeBench verdicts forged from inside the candidate (issue 42 item 2): each trick, appended to a
wrong body of BigCodeBench/0 (or replacing it), scores 0 with the reason the harness gives, next to
the honest correct solution passing and the honest wrong one failing. On the harness before this
one, 15 of these 34 rows scored 1.0 (the first six are issue 42's; three ran zero tests); the
official harness (bigcodebench 0.2.5) passes 14 of the 32 it can run (it waits out its time limit
on the two ``os._exit`` rows). The tests named "what remains" pin the in-process attacks README's
threat model says still pass, so the claim stays true."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dlm_toolkit.tasks import get_task
from dlm_toolkit.tasks.sandbox import sandbox_info
from dlm_toolkit.tasks.unittest_box import run_unittest, static_test_facts

FIX = Path(__file__).resolve().parent / "fixtures" / "bigcodebench"

if sandbox_info().bwrap is None:  # the test-deps script installs bubblewrap; the grading is its point
    pytest.skip(f"bubblewrap is not usable here: {sandbox_info().bwrap_problem}", allow_module_level=True)

WRONG = "    os.listdir(directory)\n    return []\n"  # fails test_filters_and_sorts and test_real_directory only
MODIFIED = "the candidate modified the test machinery: "
FORGED_REPORT = b'{"status": "pass", "tests": 3, "failed": {}, "ok": ["test_filters_and_sorts", "test_no_match", ' \
                b'"test_real_directory"], "reason": ""}'

# name -> (completion: a body of task_func, then module-level code; the reason the verdict gives)
TRICKS = {
    # ---- the six that passed before
    "assertEqual patched to a no-op": (
        WRONG + "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n",
        MODIFIED + "unittest.case.TestCase.assertEqual was replaced"),
    "TestCase.run patched to a no-op": (
        WRONG + "import unittest\nunittest.TestCase.run = lambda self, result=None: result\n",
        MODIFIED + "unittest.case.TestCase.run was replaced"),
    "TestLoader returns an empty suite": (
        WRONG + "import unittest\nunittest.TestLoader.loadTestsFromTestCase = lambda self, c: unittest.TestSuite()\n",
        MODIFIED + "unittest.loader.TestLoader.loadTestsFromTestCase was replaced"),
    "__build_class__ strips the test methods": (
        WRONG + "import builtins\n_bc = builtins.__build_class__\n"
                "def _strip(f, name, *b, **k):\n    cls = _bc(f, name, *b, **k)\n"
                "    for key in [key for key in vars(cls) if key.startswith('test')]:\n        delattr(cls, key)\n"
                "    return cls\nbuiltins.__build_class__ = _strip\n",
        MODIFIED + "builtins.__build_class__ was replaced"),
    "TestResult.addFailure patched to a no-op": (
        WRONG + "import unittest\nunittest.TestResult.addFailure = lambda *a, **k: None\n",
        MODIFIED + "unittest.result.TestResult.addFailure was replaced"),
    "forged report to the high fd, then /dev/null dup2-ed over it": (
        WRONG + f"os.write(900, {FORGED_REPORT!r})\n_n = os.open('/dev/null', os.O_WRONLY)\nos.dup2(_n, 900)\n",
        "a report without the run's nonce reached the report channel (forged)"),
    # ---- more of the same kind
    "__build_class__ strips the tests, then restores itself": (
        WRONG + "import builtins\n_bc = builtins.__build_class__\n"
                "def _strip(f, name, *b, **k):\n    cls = _bc(f, name, *b, **k)\n"
                "    if name == 'TestCases':\n        builtins.__build_class__ = _bc\n"
                "        for key in [key for key in vars(cls) if key.startswith('test')]:\n            delattr(cls, key)\n"
                "    return cls\nbuiltins.__build_class__ = _strip\n",
        "3 test(s) the module defines were not collected: test_filters_and_sorts, test_no_match, test_real_directory"),
    "TestCase.__init_subclass__ strips the tests": (
        WRONG + "import unittest\ndef _strip(cls, **kw):\n"
                "    for key in [key for key in vars(cls) if key.startswith('test')]:\n        delattr(cls, key)\n"
                "unittest.TestCase.__init_subclass__ = classmethod(_strip)\n",
        MODIFIED + "unittest.case.TestCase.__init_subclass__ was replaced"),
    "TestCase.__getattribute__ added": (
        WRONG + "import unittest\n"
                "unittest.TestCase.__getattribute__ = lambda s, n: (lambda *a, **k: None) if n.startswith('assert') "
                "else object.__getattribute__(s, n)\n",
        MODIFIED + "unittest.case.TestCase.__getattribute__ was added"),
    "mock.patch replaced before the tests import it": (
        WRONG + "import unittest.mock\nunittest.mock.patch = lambda *a, **k: (lambda f: (lambda self: None))\n",
        MODIFIED + "unittest.mock.patch was replaced"),
    "sys.modules['unittest'] replaced by a fake": (
        WRONG + "import sys, types\n_fake = types.ModuleType('unittest')\n"
                "class TestCase:\n    def run(self, result=None):\n        return result\n"
                "_fake.TestCase = TestCase\nsys.modules['unittest'] = _fake\n",
        MODIFIED + "sys.modules['unittest'] was replaced"),
    "a builtin the tests call replaced": (
        WRONG + "import builtins\nbuiltins.sorted = lambda *a, **k: ['a.txt', 'b.txt']\n",
        MODIFIED + "builtins.sorted was replaced"),
    "the other tests replaced while the first runs, each no-op restoring its test": (
        "    import sys\n    os.listdir(directory)\n    cls = sys.modules['__test__'].TestCases\n"
        "    for name in ('test_no_match', 'test_real_directory'):\n"
        "        def noop(self, *a, _name=name, _orig=cls.__dict__[name]):\n"
        "            setattr(cls, _name, _orig)\n"
        "        setattr(cls, name, noop)\n    return ['a.txt', 'b.txt']\n",
        MODIFIED + "TestCases.test_no_match was replaced"),
    "assertEqual patched at call time, restoring itself when called": (  # never called: the original is bound
        "    import unittest\n    os.listdir(directory)\n    orig = unittest.TestCase.assertEqual\n"
        "    def once(*a, **k):\n        unittest.TestCase.assertEqual = orig\n"
        "    unittest.TestCase.assertEqual = once\n    return []\n",
        MODIFIED + "unittest.case.TestCase.assertEqual was replaced"),
    "SkipTest raised by the candidate": (
        "    import unittest\n    raise unittest.SkipTest('not today')\n",
        "test_filters_and_sorts was skipped by a SkipTest the test did not raise itself"),
    "unittest's internal _ShouldStop raised by the candidate": (
        "    import unittest.case\n    raise unittest.case._ShouldStop()\n",
        "test_filters_and_sorts did not run to its end (an exception unittest swallows ended it)"),
    "an expected-failure mark put on the tests": (
        "    import sys\n    os.listdir(directory)\n    for f in vars(sys.modules['__test__'].TestCases).values():\n"
        "        if callable(f):\n            f.__unittest_expecting_failure__ = True\n    return ['a.txt', 'b.txt']\n",
        "test_no_match was counted as an expected failure the test module does not declare"),
    "the class-setup-failed flag set by the candidate": (
        "    import sys\n    os.listdir(directory)\n    sys.modules['__test__'].TestCases._classSetupFailed = True\n"
        "    return ['a.txt', 'b.txt']\n",
        "test_no_match never ran (and 1 more)"),
    "a trace function (could jump over the assertions)": (
        WRONG + "import sys\nsys.settrace(lambda *a: None)\n",
        "the candidate reached into the harness: it called sys.settrace"),
    "gc.get_objects to find the harness's state": (
        WRONG + "import gc\n_all = gc.get_objects()\n",
        "the candidate reached into the harness: it called gc.get_objects"),
    "an audit hook of its own": (
        WRONG + "import sys\nsys.addaudithook(lambda *a: None)\n",
        "the candidate reached into the harness: it installed an audit hook"),
    "a forged report in every descriptor": (
        WRONG + f"for _fd in range(3, 1024):\n    try:\n        os.write(_fd, {FORGED_REPORT!r})\n"
                "    except OSError:\n        pass\n",
        "more than one report, or a garbled one, reached the report channel"),
    "the report channel replaced by /dev/null": (
        WRONG + "_n = os.open('/dev/null', os.O_WRONLY)\nos.dup2(_n, 900)\n",
        "the candidate replaced the report channel (the harness found another file at its number)"),
    "test methods swapped for the candidate's by a self-restoring __build_class__": (
        WRONG + "import builtins\n_bc = builtins.__build_class__\n"
                "def _swap(f, name, *b, **k):\n    cls = _bc(f, name, *b, **k)\n"
                "    if name == 'TestCases':\n        builtins.__build_class__ = _bc\n"
                "        for key in [key for key in vars(cls) if key.startswith('test')]:\n"
                "            setattr(cls, key, lambda self, *a: None)\n"
                "    return cls\nbuiltins.__build_class__ = _swap\n",
        MODIFIED + "TestCases.test_filters_and_sorts is the candidate's code"),
    "a test swapped for a library function by a self-restoring __build_class__": (
        WRONG + "import builtins, logging\n_bc = builtins.__build_class__\n"
                "def _swap(f, name, *b, **k):\n    cls = _bc(f, name, *b, **k)\n"
                "    if name == 'TestCases':\n        builtins.__build_class__ = _bc\n"
                "        cls.test_real_directory = logging.disable\n"
                "    return cls\nbuiltins.__build_class__ = _swap\n",
        MODIFIED + "TestCases.test_real_directory is not the test module's code"),
    "code compiled under the tests' file name": (
        WRONG + "_fake = compile('def test(self):\\n    pass\\n', '__test__.py', 'exec')\n",
        "the candidate reached into the harness: it compiled code under the tests' file name"),
    "a function's __code__ rewritten": (
        WRONG + "def _a():\n    pass\ndef _b():\n    pass\n_a.__code__ = _b.__code__\n",
        "the candidate reached into the harness: it assigned a function's __code__"),
    "/proc/self/mem opened": (
        WRONG + "try:\n    open('/proc/self/mem', 'rb').close()\nexcept OSError:\n    pass\n",
        "the candidate reached into the harness: it opened /proc/self/mem"),
    "a name the test module binds rebound while the tests run": (
        "    globals()['patch'] = None\n    return []\n",
        MODIFIED + "the test module's 'patch' was rebound"),
    "json's encoder patched to rewrite the harness's own report": (
        WRONG + "import json\n_encode = json.JSONEncoder.encode\n"
                "def _rewrite(self, o):\n"
                "    if isinstance(o, dict) and 'nonce' in o:\n"
                "        o = {**o, 'status': 'pass', 'failed': {}, 'reason': '',\n"
                "             'ok': ['test_filters_and_sorts', 'test_no_match', 'test_real_directory']}\n"
                "    return _encode(self, o)\njson.JSONEncoder.encode = _rewrite\n",
        "failed: test_filters_and_sorts, test_real_directory"),
    "sys.exit(0) at import": (WRONG + "import sys\nsys.exit(0)\n", "the test module failed to load: SystemExit: 0"),
    "os._exit(0) at import": (WRONG + "os._exit(0)\n", "the process ended (exit status 0) before the tests reported"),
    "os._exit(0) from the first call": ("    os._exit(0)\n", "the process ended (exit status 0) before the tests reported"),
    "KeyboardInterrupt from the first call": ("    raise KeyboardInterrupt\n",
                                              "the test run raised KeyboardInterrupt"),
}


@pytest.fixture(scope="module")
def quick():
    task = get_task("bigcodebench", data=str(FIX), timeout_s=20)
    return task, {i.meta["task_id"]: i for i in task.instances(10, 0, "eval")}["BigCodeBench/0"]


@pytest.fixture(scope="module")
def verdicts(quick):
    """Every trick graded once, three at a time (each run is a sandboxed interpreter)."""
    task, inst = quick
    with ThreadPoolExecutor(3) as pool:
        return dict(zip(sorted(TRICKS), pool.map(lambda t: task.run(inst, TRICKS[t][0]), sorted(TRICKS))))


def test_the_honest_solutions_set_the_baseline(quick):
    task, inst = quick
    right, wrong = task.run(inst, inst.reference), task.run(inst, WRONG)
    assert right.passed and right.tests_run == 3 and right.reason == ""
    assert not wrong.passed and wrong.reason.startswith("failed: test_filters_and_sorts, test_real_directory")


@pytest.mark.parametrize("trick", sorted(TRICKS))
def test_a_trick_scores_zero_with_its_reason(verdicts, trick):
    result = verdicts[trick]
    assert not result.passed and result.reason.startswith(TRICKS[trick][1]), result


def test_what_remains_an_object_that_equals_everything_passes(quick):
    """README's threat model, pinned: candidate and tests share objects, so a returned value whose
    ``__eq__`` is always true decides ``assertEqual`` (the official harness is fooled alike; only
    a plain-data boundary, impossible where the tests patch the candidate's calls, would stop it)."""
    task, inst = quick
    liar = ("    os.listdir(directory)\n    class Liar(list):\n        def __eq__(self, other):\n"
            "            return True\n    return Liar()\n")
    assert task.run(inst, liar).passed


def test_what_remains_the_harness_reached_through_the_frames_passes(quick):
    """README's threat model, pinned: the candidate runs in the harness's process, so code written
    against this harness can walk ``sys._getframe().f_back`` to the harness's own frames, call its
    report function (which adds the nonce) and echo the runner's token. No ordinary means does it:
    every object it uses is private to the harness, reached only through frame introspection."""
    task, inst = quick
    deep = ("    import sys\n    f, report, cfg = sys._getframe(), None, None\n    while f is not None:\n"
            "        report = f.f_locals.get('report', report) if f.f_code.co_name == '_grade' else report\n"
            "        found = f.f_globals.get('cfg')\n"
            "        cfg = found if isinstance(found, dict) and 'token_fd' in found else cfg\n"
            "        f = f.f_back\n"
            "    report(status='pass', tests=3, failed={}, reason='',\n"
            "           ok=['test_filters_and_sorts', 'test_no_match', 'test_real_directory'])\n"
            "    os.write(cfg['result_fd'], os.read(cfg['token_fd'], 64))\n    os._exit(0)\n")
    assert task.run(inst, deep).passed


def test_a_report_leaving_out_a_defined_test_is_refused_by_the_evaluators_count(quick, monkeypatch):
    """Defence in depth: with the harness's own check of collected tests removed, a candidate that
    deletes a test before collection gets a passing report -- which the evaluator refuses, having
    counted the tests in the module's text (near miss: the intact harness refuses it first)."""
    import dlm_toolkit.tasks.unittest_box as box

    task, inst = quick
    right = "    return sorted(n for n in os.listdir(directory) if re.fullmatch(pattern, n))\n"
    hide = right + ("import builtins\n_bc = builtins.__build_class__\n"
                    "def _drop(f, name, *b, **k):\n    cls = _bc(f, name, *b, **k)\n"
                    "    if name == 'TestCases':\n        builtins.__build_class__ = _bc\n"
                    "        del cls.test_real_directory\n    return cls\nbuiltins.__build_class__ = _drop\n")
    assert task.run(inst, hide).reason.startswith("1 test(s) the module defines were not collected: test_real_dir")
    source = box.harness_source()
    check = "    if missing:\n"
    assert check in source
    monkeypatch.setattr(box, "harness_source", lambda: source.replace(check, "    if False:\n"))
    assert task.run(inst, hide).reason == "the report leaves out 1 test(s) the module defines: test_real_directory"


def test_a_method_patched_before_the_test_looks_it_up_is_never_the_one_called():
    """The candidate patches ``assertEqual`` when called, to restore itself when it is called: a test
    that calls the candidate and then asserts would call the patch (and pass, the record intact by
    the end of the test). The harness binds the recorded method to each test, so the original fails
    the test and the patch, never called, is still there when the record is compared."""
    tests = ("import unittest\n\n\nclass TestCases(unittest.TestCase):\n    def test_value(self):\n"
             "        out = task_func()\n        self.assertEqual(out, 1)\n")
    program = ("import unittest\n_orig = unittest.TestCase.assertEqual\n"
               "def _once(*a, **k):\n    unittest.TestCase.assertEqual = _orig\n"
               "def task_func():\n    unittest.TestCase.assertEqual = _once\n    return 2\n")
    result = run_unittest(program, tests, timeout_s=20)
    assert not result.passed and result.reason == MODIFIED + "unittest.case.TestCase.assertEqual was replaced"
    assert run_unittest("def task_func():\n    return 1\n", tests, timeout_s=20).passed  # near miss: honest


def test_a_subtest_cut_short_by_an_exception_unittest_swallows_fails():
    tests = ("import unittest\n\n\nclass TestCases(unittest.TestCase):\n    def test_cases(self):\n"
             "        for i in range(2):\n            with self.subTest(i=i):\n"
             "                self.assertEqual(task_func(i), i + 1)\n")
    honest = run_unittest("def task_func(i):\n    return i + 1\n", tests, timeout_s=20)
    cut = run_unittest("import unittest.case\ndef task_func(i):\n    raise unittest.case._ShouldStop()\n", tests,
                       timeout_s=20)
    assert honest.passed, honest
    assert cut.reason == "test_cases: a subtest ended without an outcome (an exception unittest swallows)", cut


def test_zero_tests_or_fewer_than_defined_is_a_failure():
    """A module whose TestCases has no test fails (near miss: one test passes); a report listing fewer
    tests than the text defines is refused by the evaluator's own count."""
    empty = "import unittest\n\n\nclass TestCases(unittest.TestCase):\n    pass\n"
    one = empty.replace("pass\n", "def test_one(self):\n        self.assertEqual(task_func(), 1)\n")
    program = "def task_func():\n    return 1\n"
    assert run_unittest(program, empty, timeout_s=20).reason == "no test ran: TestCases defines no test method"
    assert run_unittest(program, one, timeout_s=20).passed
    facts = static_test_facts(one.replace("class TestCases(unittest.TestCase)", "class Base(unittest.TestCase)")
                              + "\n\nclass TestCases(Base):\n    def test_two(self):\n        pass\n")
    assert facts["tests"] == ["test_one", "test_two"]  # inherited from the module's own base class


def test_async_test_cases_run_through_their_own_recorded_methods():
    """``IsolatedAsyncioTestCase`` is recorded with the rest of unittest and its own
    ``_callTestMethod`` (which awaits the coroutine) is the one bound: honest code passes, wrong fails."""
    tests = ("import unittest\n\n\nclass TestCases(unittest.IsolatedAsyncioTestCase):\n"
             "    async def test_value(self):\n        self.assertEqual(task_func(), 1)\n")
    assert run_unittest("def task_func():\n    return 1\n", tests, timeout_s=20).passed
    assert run_unittest("def task_func():\n    return 2\n", tests, timeout_s=20).reason.startswith("failed: test_value")


def test_skips_and_expected_failures_the_module_declares_still_count():
    """As the official harness: a test the module itself skips (decorator or self.skipTest) or
    declares an expected failure does not fail the task; the same skip raised by the candidate does."""
    tests = ("import unittest\n\n\nclass TestCases(unittest.TestCase):\n"
             "    def test_value(self):\n        self.assertEqual(task_func(), 1)\n\n"
             "    @unittest.skip('declared')\n    def test_skipped(self):\n        self.fail()\n\n"
             "    def test_skips_itself(self):\n        self.skipTest('asked')\n\n"
             "    @unittest.expectedFailure\n    def test_known_bug(self):\n        self.assertEqual(1, 2)\n")
    assert run_unittest("def task_func():\n    return 1\n", tests, timeout_s=20).passed
    sneaky = "import unittest\ndef task_func():\n    raise unittest.SkipTest('x')\n"
    assert run_unittest(sneaky, tests, timeout_s=20).reason == (
        "test_value was skipped by a SkipTest the test did not raise itself")
