"""The trusted harness a BigCodeBench test module runs under, inside the sandbox (never imported:
:mod:`~dlm_toolkit.tasks.unittest_box` sends this file's source as the script of a sandboxed run,
followed by ``_main(<payload>)``).

The candidate's program and the benchmark's tests share one interpreter (the tests patch what the
candidate calls), so the candidate can reach every *public* object the tests use. The verdict
therefore depends on none of them; everything below runs before any candidate byte:

1. The run's nonce is read from a pipe that is then closed: only this harness's memory holds it,
   and the evaluator accepts only a report carrying it. Writing a report into every descriptor,
   or a forged report followed by ``dup2``, never passes; the report descriptor is checked to be
   the pipe it was (``fstat``) before the one write.
2. ``unittest`` and the modules the tests import (``unittest.mock`` among them) are imported, and the
   machinery is recorded: the dictionaries of ``builtins`` and of every ``unittest`` module and
   class, the attributes the tests name from the modules they import (``np.testing.assert_allclose``),
   the dictionaries of the classes they name (with their bases), and those ``sys.modules`` entries. The test runner's functions are taken from that record, not from the
   live classes.
3. An audit hook (``sys.addaudithook``; it cannot be removed) flags what only an attack on this
   harness needs: another audit hook (refused), a trace or profile function, ``gc.get_objects``
   / ``gc.get_referrers``, ``sys._current_frames``, opening ``/proc/*/mem``, assigning a
   function's ``__code__``, and compiling code under the tests' file name.

Then the program and the tests are compiled separately (``__candidate__.py``, ``__test__.py``) and
run in one module namespace, as the official harness runs their concatenation. After loading, after
every test and after the run, the record is compared by identity (a replaced, added or removed entry:
"the candidate modified the test machinery: ..."); the test classes, their methods and the names the
test module binds are recorded once loaded and held to the same rule. The tests run through the
recorded ``TestSuite.run``/``TestCase.run`` with every inherited ``unittest`` method bound to each
instance from the record (so ``TestCase.assertEqual = ...`` changes nothing the tests call), and
the outcome of each test is counted by this harness's own result object. A task passes only if
every test the module defines (the evaluator counts them in the text; at least one) was collected,
ran to its end and succeeded -- a skip or an expected failure counts only where the test module
itself asks for it.
"""

from .unittest_record import _describe, _encode, _pin, _Record  # noqa: F401 -- for readers and linters

raise ImportError("dlm_toolkit.tasks.unittest_harness is the script every BigCodeBench run executes, not a "
                  "module to import (see dlm_toolkit.tasks.unittest_box.harness_source)")

# ---- the sandbox runs what follows, after unittest_record.py's source ----
import builtins as _builtins  # noqa: E402
import fcntl as _fcntl  # noqa: E402
import json as _json  # noqa: E402
import os as _os  # noqa: E402
import sys as _sys  # noqa: E402

_HIGH_FD = 900  # the report pipe's new number: high, close-on-exec (child processes never hold it)
_CANDIDATE_FILE = "__candidate__.py"
_TESTS_FILE = "__test__.py"


def _main(payload_text):
    payload = _json.loads(payload_text)
    nonce = b""
    while len(nonce) < 32:
        part = _os.read(payload["nonce_fd"], 32 - len(nonce))
        if not part:
            break
        nonce += part
    _os.close(payload["nonce_fd"])
    nonce = nonce.decode("ascii", "replace")
    fd = _fcntl.fcntl(payload["report_fd"], _fcntl.F_DUPFD_CLOEXEC, _HIGH_FD)
    _os.close(payload["report_fd"])
    channel = _os.fstat(fd)
    channel = (channel.st_dev, channel.st_ino)
    _sys.argv[:] = [_TESTS_FILE]
    import site
    for folder in payload["binds"]:
        site.addsitedir(folder)
    write, encode, fstat, exit_now = _os.write, _encode, _os.fstat, _os._exit

    def report(**fields):
        try:
            st = fstat(fd)
            same = (st.st_dev, st.st_ino) == channel
        except OSError:
            same = False
        if not same:  # the candidate put something else at the report's number: no verdict at all
            exit_now(5)
        write(fd, encode({"nonce": nonce, **fields}).encode("ascii"))

    if payload["mode"] == "probe":
        import importlib.util
        found = {}
        for name in payload["modules"]:
            try:
                found[name] = importlib.util.find_spec(name) is not None
            except Exception:
                found[name] = False
        report(found=found)
        return
    _grade(payload, report)


def _grade(payload, report):
    import importlib
    import time
    import types
    import unittest  # unittest.mock and unittest.async_case come with the tests' modules, where they name them

    home = _os.getcwd()  # the run's own folder
    for name in ("mpl", "work"):
        _os.mkdir(_os.path.join(home, name))
    settings = {"TZ": "UTC", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "MPLBACKEND": "Agg", "MPLCONFIGDIR": _os.path.join(home, "mpl")}
    _os.environ.update(settings)
    time.tzset()
    _os.chdir(_os.path.join(home, "work"))
    static = payload["static"]

    # ---- what the tests import, imported first (the tests import it anyway), then recorded
    sink = open(_os.devnull, "w")
    _sys.stdout = _sys.stderr = sink
    for name in static["modules"]:
        try:
            importlib.import_module(name)
        except BaseException:  # the tests' own import fails the same way, with its reason
            pass
    _sys.stdout = _sys.stderr = sink

    FunctionType, MethodType, ModuleType = types.FunctionType, types.MethodType, types.ModuleType
    isinstance_, issubclass_, type_, id_, len_, getattr_ = isinstance, issubclass, type, id, len, getattr
    sorted_, list_, set_, str_, vars_ = sorted, list, set, str, vars
    modules_now = _sys.modules  # the interpreter's own registry, whatever ``sys.modules`` is later bound to
    machinery_names = frozenset(n for cls in (unittest.TestCase, unittest.TestResult, unittest.TestSuite)
                                for base in cls.__mro__ for n in vars(base))
    record = _Record(frozenset(vars(_builtins)), machinery_names)
    record.add("builtins", vars(_builtins), "builtins")
    sys_entries = {n: m for n, m in modules_now.items() if n == "unittest" or n.startswith("unittest.")}
    originals = {}  # recorded class -> its dictionary as recorded
    for name, module in sys_entries.items():
        record.add(name, module, "module")
        for value in list_(vars(module).values()):
            if isinstance_(value, type) and str_(getattr_(value, "__module__", "")).startswith("unittest"):
                originals.setdefault(value, None)
    for chain in static["chains"]:  # what the tests name: np.testing.assert_allclose, pd.DataFrame, ...
        obj, label = modules_now.get(chain[0]), chain[0]
        if isinstance_(obj, ModuleType):
            sys_entries.setdefault(chain[0], obj)
        for attr in chain[1:]:
            if not isinstance_(obj, (ModuleType, type)):
                break
            if isinstance_(obj, type):
                originals.setdefault(obj, None)
                obj = getattr_(obj, attr, None)
            else:
                obj, owner = obj.__dict__.get(attr), obj
                if obj is not None:  # absent: a lazily loaded submodule (numpy.random), nothing to hold yet
                    record.add(label, owner, "attribute", attr)
            label = f"{label}.{attr}"
        if isinstance_(obj, type):
            originals.setdefault(obj, None)
    for cls in list_(originals):
        for base in cls.__mro__:
            if base is not object:
                originals.setdefault(base, None)
    for cls in originals:
        originals[cls] = dict(cls.__dict__)
        record.add(f"{cls.__module__}.{cls.__qualname__}", cls, "class")

    TestCase, TestSuite, TestLoader = unittest.TestCase, unittest.TestSuite, unittest.TestLoader
    TestResult, SubTest = unittest.TestResult, unittest.case._SubTest
    suite_run = originals[TestSuite]["run"]

    result_init, exc_to_string = originals[TestResult]["__init__"], originals[TestResult]["_exc_info_to_string"]

    # ---- the audit hook: what only an attack on this harness needs
    flags = []
    armed = [False]
    tests_file = _TESTS_FILE

    def audit(event, args):
        if not armed[0]:
            return
        if event == "sys.addaudithook":
            flags.append("installed an audit hook")
            raise RuntimeError("the sandbox refuses another audit hook")
        if event in ("sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "sys._current_frames"):
            flags.append(f"called {event}")
        elif event == "open" and args and isinstance_(args[0], str_) and args[0].startswith("/proc/") \
                and args[0].endswith("/mem"):
            flags.append(f"opened {args[0]}")
        elif event == "object.__setattr__" and len_(args) > 1 and args[1] == "__code__":
            flags.append("assigned a function's __code__")
        elif event == "compile" and len_(args) > 1 and args[1] == tests_file:
            flags.append("compiled code under the tests' file name")

    _sys.addaudithook(audit)

    # ---- load: the program, then the tests, in one module namespace
    def fail(reason, tests=0, failed=None):
        report(status="fail", tests=tests, failed=failed or {}, ok=[], reason=reason)

    try:
        compile(payload["program"] + "\n" + payload["tests"], tests_file, "exec")
        program = compile(payload["program"], _CANDIDATE_FILE, "exec")
        tests = compile(payload["tests"], tests_file, "exec")
    except BaseException as exc:
        return fail(f"the program does not compile: {type(exc).__name__}: {exc}")
    module = ModuleType("__test__")
    namespace = module.__dict__
    namespace.update({"__builtins__": _builtins, "__file__": tests_file, "__package__": None,
                      "__doc__": None, "sys": _sys, "os": _os, "environ": _os.environ})
    armed[0] = True
    try:
        exec(program, namespace)
        exec(tests, namespace)
        modules_now["__test__"] = module
    except BaseException as exc:
        return fail(f"the test module failed to load: {_describe(exc)}")

    def tampered():
        """Why the verdict cannot be trusted any more ('' while nothing changed)."""
        if flags:
            return f"the candidate reached into the harness: it {flags[0]}"
        for name, mod in sys_entries.items():
            if modules_now.get(name) is not mod:
                return f"the candidate modified the test machinery: sys.modules[{name!r}] was replaced"
        why = record.changed()
        return f"the candidate modified the test machinery: {why}" if why else ""

    why = tampered()
    if why:
        return fail(why)
    cases = namespace.get("TestCases")
    if not (isinstance_(cases, type_) and issubclass_(cases, TestCase)):
        return fail("the test module failed to load: NameError: the test module defines no unittest.TestCase "
                    "named TestCases")
    defined_classes = {id_(namespace.get(n)) for n in static["classes"] if isinstance_(namespace.get(n), type_)}
    for cls in cases.__mro__:
        if cls is object or cls in originals:
            continue
        if id_(cls) not in defined_classes or type_(cls) is not type_:
            return fail(f"the candidate modified the test machinery: TestCases inherits from {cls.__qualname__}, "
                        "which the test module does not define")
        for key, value in list_(vars(cls).items()):
            inner = value.__func__ if isinstance_(value, (staticmethod, classmethod)) else value
            for _ in range(50):  # decorators (mock.patch) wrap the test: none may be the candidate's
                code = getattr_(inner, "__code__", None)
                if code is not None and code.co_filename == _CANDIDATE_FILE:
                    return fail(f"the candidate modified the test machinery: {cls.__qualname__}.{key} is "
                                "the candidate's code")
                inner = getattr_(inner, "__wrapped__", None)
                if inner is None:
                    break
        record.add(cls.__qualname__, cls, "test class")
    bound = {n: namespace[n] for n in static["globals"] if n in namespace}
    loader = TestLoader()
    _pin(loader, originals, MethodType, FunctionType)
    names = list_(loader.getTestCaseNames(cases))
    missing = sorted_(set_(static["tests"]) - set_(names))
    if missing:
        return fail(f"{len_(missing)} test(s) the module defines were not collected: {', '.join(missing[:20])}")
    if not names:
        return fail("no test ran: TestCases defines no test method")

    def recorded(cls, name):
        """``cls.name`` as the record has it (a method of the tests' own classes as loaded)."""
        for base in cls.__mro__:
            saved = originals.get(base)
            if saved is None and name in base.__dict__:
                return base.__dict__[name]
            if saved is not None and name in saved:
                return saved[name]
        raise AttributeError(name)

    for name in names:  # each test is the module's own code, under decorators that keep ``__wrapped__``
        inner = recorded(cases, name)
        for _ in range(50):
            inner = inner.__func__ if isinstance_(inner, (staticmethod, classmethod)) else inner
            if getattr_(inner, "__wrapped__", None) is None:
                break
            inner = inner.__wrapped__
        code = getattr_(inner, "__code__", None)
        if code is None or code.co_filename != _TESTS_FILE:
            return fail(f"the candidate modified the test machinery: TestCases.{name} is not the test module's code")

    # ---- run: our own result, the recorded runner functions, every inherited method bound from the record
    state = {"outcomes": {}, "started": [], "completed": set_(), "skip_asked": set_(),
             "subtests_entered": {}, "subtests_closed": {}, "trace": {}, "changed": ""}
    instances = {}

    def owner(test):
        name = instances.get(id_(test))
        if name is None and isinstance_(test, SubTest):
            name = instances.get(id_(test.test_case))
        return name

    def note(test, outcome, err=None):
        name = owner(test) or "<class or module fixture>"
        state["outcomes"].setdefault(name, []).append(outcome)
        if err is not None and name not in state["trace"]:
            state["trace"][name] = ""
            try:
                state["trace"][name] = str_(exc_to_string(result, err, test))[-600:]
            except BaseException:
                state["trace"][name] = "(the traceback could not be formatted)"

    class Result(TestResult):
        def startTest(self, test):
            state["started"].append(owner(test))

        def stopTest(self, test):
            if not state["changed"]:
                state["changed"] = tampered()

        def addSuccess(self, test):
            note(test, "success")

        def addFailure(self, test, err):
            note(test, "failure", err)

        def addError(self, test, err):
            note(test, "error", err)

        def addSkip(self, test, reason):
            note(test, "skip")
            if isinstance_(test, SubTest):
                state["subtests_closed"][owner(test)] = state["subtests_closed"].get(owner(test), 0) + 1

        def addExpectedFailure(self, test, err):
            note(test, "expected failure")

        def addUnexpectedSuccess(self, test):
            note(test, "unexpected success")

        def addSubTest(self, test, subtest, err):
            name = owner(test)
            state["subtests_closed"][name] = state["subtests_closed"].get(name, 0) + 1
            if err is not None:
                note(subtest, "subtest failure", err)

    orig_call_test, orig_skip_test = recorded(cases, "_callTestMethod"), recorded(cases, "skipTest")
    orig_subtest = recorded(cases, "subTest")

    def call_test(self, method):
        orig_call_test(self, method)
        state["completed"].add(instances.get(id_(self)))  # ran to its end (nothing swallowed part of it)

    def skip_test(self, reason):
        state["skip_asked"].add(instances.get(id_(self)))
        orig_skip_test(self, reason)

    class SubTestCounter:
        def __init__(self, test, args, kwargs):
            self.inner = orig_subtest(test, *args, **kwargs)
            self.name = instances.get(id_(test))

        def __enter__(self):
            value = self.inner.__enter__()
            state["subtests_entered"][self.name] = state["subtests_entered"].get(self.name, 0) + 1
            return value

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    def sub_test(self, *args, **kwargs):
        return SubTestCounter(self, args, kwargs)

    result = Result()
    result_init(result)
    _pin(result, originals, MethodType, FunctionType, own=Result)
    tests = []
    for name in names:
        test = cases(name)
        instances[id_(test)] = name
        _pin(test, originals, MethodType, FunctionType)
        test.__dict__.update(_callTestMethod=MethodType(call_test, test), skipTest=MethodType(skip_test, test),
                             subTest=MethodType(sub_test, test))
        tests.append(test)
    suite = TestSuite(tests)
    _pin(suite, originals, MethodType, FunctionType)
    try:
        suite_run(suite, result)
    except BaseException as exc:
        return fail(f"the test run raised {_describe(exc)}", tests=len_(state["started"]))
    why = state["changed"] or tampered()
    for name, value in bound.items():
        if not why and namespace.get(name) is not value:
            why = f"the candidate modified the test machinery: the test module's {name!r} was rebound"
    if why:
        return fail(why, tests=len_(state["started"]))

    # ---- the verdict, from this harness's own counts
    failed, problems, ok = {}, [], []
    for name in names:
        outcomes = state["outcomes"].get(name, [])
        trace = state["trace"].get(name, "")
        bad = [o for o in outcomes if o in ("failure", "error", "subtest failure")]
        if bad:
            failed[name[:100]] = trace
        elif not outcomes:
            problems.append(f"{name} never ran")
        elif "skip" in outcomes:
            if name in state["skip_asked"] or name in static["skip_ok"] or "*" in static["skip_ok"]:
                ok.append(name)
            else:
                problems.append(f"{name} was skipped by a SkipTest the test did not raise itself")
        elif "expected failure" in outcomes or "unexpected success" in outcomes:
            if name in static["xfail_ok"]:
                ok.append(name)
            else:
                problems.append(f"{name} was counted as an expected failure the test module does not declare")
        elif name not in state["completed"]:
            problems.append(f"{name} did not run to its end (an exception unittest swallows ended it)")
        elif state["subtests_entered"].get(name, 0) != state["subtests_closed"].get(name, 0):
            problems.append(f"{name}: a subtest ended without an outcome (an exception unittest swallows)")
        else:
            ok.append(name)
    fixture = state["outcomes"].get("<class or module fixture>")
    if fixture:
        failed["<class or module fixture>"] = state["trace"].get("<class or module fixture>", "")
    # bounded, so the whole report fits the pipe's buffer (the evaluator reads it after the exit)
    listed = sorted_(failed)
    failed = {name: (failed[name] if i < 20 else "") for i, name in enumerate(listed[:200])}
    more = f" and {len_(listed) - 200} more" if len_(listed) > 200 else ""
    if listed:
        reason = "failed: " + ", ".join(listed[:200]) + more
    elif problems:
        reason = problems[0] + (f" (and {len_(problems) - 1} more)" if len_(problems) > 1 else "")
    else:
        reason = ""
    # the evaluator checks the tests it counted in the text: only those are listed, within the pipe's buffer
    listed_tests = set_(static["tests"])
    ok = [name for name in ok if name in listed_tests]
    if sum(len_(name) + 4 for name in ok) > 48_000:
        ok, reason = [], reason or "the test module's tests are too many to list in the report"
    report(status="fail" if reason else "pass", tests=len_(state["started"]), failed=failed, ok=ok,
           reason=reason)
