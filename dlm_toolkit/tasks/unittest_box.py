"""Run a benchmark's ``unittest`` module against a candidate program in one sandboxed process, with the
libraries of a Python environment visible inside (BigCodeBench's way of testing).

Why one process: BigCodeBench's tests call the candidate function in-process and patch what it uses
(``unittest.mock.patch('requests.get')``, ``patch('os.listdir')``), so the plain-data boundary of
:func:`~dlm_toolkit.tasks.sandbox.run_tests` cannot apply: candidate and tests share one interpreter,
inside the bubblewrap sandbox (:class:`~dlm_toolkit.tasks.sandbox.process.SandboxProcess`, mode
``script``).

How the verdict travels (:func:`run_unittest`): the trusted harness (``unittest_harness.py``, the
script of the run; everything before the candidate's first byte is ours) reads a per-run nonce from
a pipe and closes it, moves the report pipe to a high close-on-exec descriptor, records the test
machinery, runs the program and then the tests in module ``__test__``, runs ``TestCases`` with its
own runner and writes one JSON report carrying the nonce (see that module's docstring). The
evaluator passes a task only if (1) exactly one well-formed report arrived, carrying the nonce and
saying every test passed, (2) it names every test the module's text defines
(:func:`static_test_facts`, counted here, outside the sandbox), (3) the harness returned normally
(the runner echoes the per-run token only after it did) and (4) the process exited 0 within the
time limit. So printing, ``sys.exit(0)``, ``os._exit(0)``, killing itself, a crash, a hang, a forged
report (it lacks the nonce), a replaced report descriptor, patching ``unittest``, ``builtins`` or
what the tests name, skipping or swallowing tests never pass.

Threat model, honestly: candidate code runs in the tests' process. What remains possible there is
listed in README ("Untrusted code, untrusted files"): values whose comparison lies, test data mutated
in place, and code written against this harness that reaches its private frames (``sys._getframe``
and ``f_back``), native memory (``ctypes``) or a thread racing its checks. What the sandbox
guarantees holds regardless: nothing outside the process is reachable (bubblewrap), and the
evaluator reads nothing back but the bounded report and capped output tails.

:func:`library_env` finds the environment's library folders; under bubblewrap they are mounted
read-only at their own paths and added with ``site.addsitedir`` (so ``.pth`` files work), provided
the sandbox's interpreter has the same ``major.minor`` as the environment's (compiled extensions).
:func:`probe_modules` asks the sandboxed interpreter which top-level modules it can find.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .sandbox import sandbox_info
from .sandbox.probe import others_can_reach, prefix_of
from .sandbox.process import SandboxProcess, read_available
from .sandbox.runner import _isolation

__all__ = ["LibraryEnv", "UnittestResult", "library_env", "probe_modules", "run_unittest", "top_level_imports"]

REPORT_LIMIT = 1 << 16


@dataclass(frozen=True)
class LibraryEnv:
    """A Python environment whose libraries the sandboxed code may import.

    Attributes:
        python: the environment's interpreter (run as is in process mode).
        binds: its library folders, mounted read-only under bubblewrap.
        problem: why its libraries are not visible under bubblewrap ('' when they are).
    """

    python: str
    binds: tuple[str, ...] = ()
    problem: str = ""


@dataclass(frozen=True)
class UnittestResult:
    """Outcome of :func:`run_unittest`.

    Attributes:
        passed: every test ran, none failed or raised; see the module docstring for the conditions.
        reason: why not ('' when passed): a timeout, the test module failing to load, the failing
            tests with the end of their tracebacks, or the process ending before its report.
        tests_run: tests the suite ran (0 if it never started).
        failed: failing or erroring test name -> the end of its traceback.
        timed_out: the wall-clock limit was hit and everything was killed.
        returncode: the process's exit status (negative: killed by that signal).
        stderr_tail: the process's own stderr (the harness silences the candidate's).
        duration_s: wall-clock seconds.
    """

    passed: bool
    reason: str
    tests_run: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    returncode: int | None = None
    stderr_tail: str = ""
    duration_s: float = 0.0


_ENV_PROBE = ("import json, sys; print(json.dumps({'path': sys.path, 'version': list(sys.version_info[:2]), "
              "'base': sys.base_prefix}))")


def _interpreter_facts(python: str) -> dict:
    out = subprocess.run([python, "-I", "-c", _ENV_PROBE], capture_output=True, text=True, timeout=60, check=True,
                         stdin=subprocess.DEVNULL).stdout
    return json.loads(out)


@functools.lru_cache(maxsize=None)
def library_env(python: str | None = None) -> LibraryEnv:
    """The library folders of the environment of ``python`` (default: this interpreter's, i.e. the
    virtual environment the toolkit runs in) as the sandbox can use them.

    Folders under ``/usr`` or the sandboxed interpreter's own prefix are visible already; the others
    (a venv's ``site-packages``) are bound. Nothing is bound when bubblewrap is not used (process
    mode runs ``python`` itself), when the sandbox's interpreter differs in ``major.minor`` (then
    ``problem`` says so and the tasks needing those libraries show up as missing), or for a folder
    the sandbox's unprivileged uid cannot read.
    """
    exe = python or sys.executable
    try:
        facts = _interpreter_facts(exe)
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        return LibraryEnv(exe, (), f"cannot run {exe}: {err}")
    info = sandbox_info(exe)
    if info.bwrap is None or info.bwrap_python is None:
        return LibraryEnv(exe)
    inner = info.bwrap_python
    inner_version = facts["version"] if os.path.realpath(inner) == os.path.realpath(exe) else \
        _interpreter_facts(inner)["version"]
    if inner_version != facts["version"]:
        return LibraryEnv(exe, (), f"the sandbox runs {inner} (Python {'.'.join(map(str, inner_version))}), "
                                   f"the environment is Python {'.'.join(map(str, facts['version']))}")
    visible = ("/usr/", prefix_of(inner).rstrip("/") + "/")
    binds, unreadable = [], []
    stdlib = facts["base"].rstrip("/") + "/"  # the environment's own stdlib: the sandbox's interpreter has one
    for entry in facts["path"]:
        if not entry or not os.path.isdir(entry) or (entry.rstrip("/") + "/").startswith(visible):
            continue
        if (entry.rstrip("/") + "/").startswith(stdlib) and "-packages" not in entry:
            continue
        real = os.path.realpath(entry)
        if real in binds:
            continue
        if os.geteuid() == 0 and not others_can_reach(real):  # the sandbox starts as a leased unprivileged uid
            unreadable.append(real)
            continue
        binds.append(real)
    problem = f"not readable by the sandbox's uid: {', '.join(unreadable)}" if unreadable else ""
    return LibraryEnv(exe, tuple(binds), problem)


_MARKER = "# ---- the sandbox runs what follows, after unittest_record.py's source ----"


@functools.lru_cache(maxsize=1)
def harness_source() -> str:
    """The trusted harness, sent as the script of every run: ``unittest_record.py``, then
    ``unittest_harness.py`` below its marker; the payload follows as ``_main(<JSON string literal>)``."""
    here = Path(__file__).parent
    harness = (here / "unittest_harness.py").read_text(encoding="utf-8")
    return (here / "unittest_record.py").read_text(encoding="utf-8") + "\n" + harness[harness.index(_MARKER):]


def _bound_names(tree: ast.Module) -> dict[str, list[str]]:
    """Names the module's top-level imports bind -> the module path they stand for
    (``import numpy as np``: ``np -> [numpy]``; ``from pandas import testing``: ``testing -> [pandas, testing]``)."""
    bound: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = [alias.name if alias.asname else
                                                                   alias.name.split(".")[0]]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.name != "*":
                    bound[alias.asname or alias.name] = [node.module, alias.name]
    return bound


def _decorated(node: ast.AST, word: str) -> bool:
    return any(word in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def _raises_skip(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Raise) and n.exc is not None and "SkipTest" in ast.unparse(n.exc)
               for n in ast.walk(node))


def static_test_facts(tests: str) -> dict:
    """What the evaluator reads from the test module's text, independently of anything that runs:
    ``tests`` (the test methods ``TestCases`` defines or inherits from the module's own classes),
    ``classes`` and ``globals`` (what its top level binds), ``modules`` and ``chains`` (what it
    imports and the attribute paths it names from them: the machinery the harness records),
    ``skip_ok``/``xfail_ok`` (tests the module itself marks as skipped or expected to fail;
    ``*``: all). A text that does not parse gives empty facts (the harness reports its syntax error)."""
    facts: dict = {"tests": [], "classes": [], "globals": [], "modules": [], "chains": [], "skip_ok": [],
                   "xfail_ok": []}
    try:
        tree = ast.parse(tests)
    except (SyntaxError, ValueError):
        return facts
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*")
    bound = _bound_names(tree)
    chains = {tuple(path) for path in bound.values()}
    for node in ast.walk(tree):
        attrs: list[str] = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if attrs and isinstance(node, ast.Name) and node.id in bound:
            chains.add(tuple(bound[node.id] + attrs[::-1]))
    for chain in chains:  # submodules of unittest reached by attribute (``unittest.mock.patch``) or lazily
        if chain[:2] == ("unittest", "mock"):
            modules.add("unittest.mock")
        if "IsolatedAsyncioTestCase" in chain:
            modules.add("unittest.async_case")
    tests_found: list[str] = []
    skip_ok: set[str] = set()
    xfail_ok: set[str] = set()
    todo, seen = ["TestCases"], set()
    while todo:
        cls = classes.get(todo.pop())
        if cls is None or cls.name in seen:
            continue
        seen.add(cls.name)
        if _decorated(cls, "skip"):
            skip_ok.add("*")
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if item.name.startswith("test"):
                    tests_found.append(item.name)
                    if _decorated(item, "skip") or _raises_skip(item):
                        skip_ok.add(item.name)
                    if _decorated(item, "expectedFailure"):
                        xfail_ok.add(item.name)
                elif item.name in ("setUp", "setUpClass") and _raises_skip(item):
                    skip_ok.add("*")
        todo.extend(b.id for b in cls.bases if isinstance(b, ast.Name))
    if "setUpModule" in names and any(_raises_skip(n) for n in tree.body
                                      if isinstance(n, ast.FunctionDef) and n.name == "setUpModule"):
        skip_ok.add("*")
    facts.update(tests=sorted(set(tests_found)), classes=sorted(classes), globals=sorted(names | set(bound)),
                 modules=sorted(modules), chains=sorted(list(c) for c in chains), skip_ok=sorted(skip_ok),
                 xfail_ok=sorted(xfail_ok))
    return facts


TMPFS_MB = 512  # size of the run's /tmp and of its working folder, each (tmpfs in the sandbox)


def _run(payload: dict, *, env: LibraryEnv, timeout_s: float, memory_mb: int, unsafe_exec: bool,
         max_processes: int, output_limit_bytes: int, isolation: str | None) -> tuple[dict | None, UnittestResult]:
    """Start the harness on ``payload``; ``(its report or None, a result holding the process facts)``."""
    if not timeout_s > 0 or not memory_mb > 0:
        raise ValueError(f"timeout_s and memory_mb must be > 0 (got {timeout_s!r}, {memory_mb!r})")
    info = sandbox_info(env.python)
    boxed = _isolation(unsafe_exec, isolation, info)  # the sandbox's own rule: process mode needs unsafe_exec
    token = os.urandom(16).hex().encode()
    nonce = os.urandom(16).hex()  # only the harness reads it, before any candidate byte (not in the code file)
    token_r, token_w = os.pipe()
    nonce_r, nonce_w = os.pipe()
    result_r, result_w = os.pipe()
    report_r, report_w = os.pipe()
    payload = {**payload, "report_fd": report_w, "nonce_fd": nonce_r}  # the child keeps the numbers (pass_fds)
    code = harness_source() + f"\n_main({json.dumps(json.dumps(payload))})\n"
    os.write(token_w, token)
    os.write(nonce_w, nonce.encode())
    os.close(token_w)
    os.close(nonce_w)
    ours = [token_r, nonce_r, result_w, report_w]
    try:
        start = time.monotonic()
        # No reliability guard: the benchmark's tasks delete files, set environment variables and start
        # processes, as the official harness allows. The boundary is bubblewrap, or in process mode
        # (unsafe_exec: a throw-away machine) the process limits and the leased uid.
        with SandboxProcess(mode="script", files={"code": code},
                            fds={"token_fd": token_r, "result_fd": result_w, "report_fd": report_w,
                                 "nonce_fd": nonce_r},
                            boxed=boxed, info=info, exe=env.python, timeout_s=timeout_s, memory_mb=memory_mb,
                            max_processes=max_processes, output_limit_bytes=output_limit_bytes, guard=False,
                            ro_binds=env.binds if boxed else (),
                            # BigCodeBench tasks write files (CSV, images, archives) to their folder and /tmp
                            tmp_mb=TMPFS_MB, workdir_mb=TMPFS_MB) as box:
            for fd in ours:
                os.close(fd)
            ours = []
            finished = box.wait(start + timeout_s)
            returncode = box.stop()
            duration = time.monotonic() - start
            _, stderr = box.tails()
        echoed = read_available(result_r, len(token) + 1) == token
        raw = read_available(report_r, REPORT_LIMIT)
    finally:
        for fd in [*ours, result_r, report_r]:
            os.close(fd)
    facts = UnittestResult(passed=False, reason="", timed_out=not finished, returncode=returncode,
                           stderr_tail=stderr, duration_s=duration)
    if not finished:
        return None, replace(facts, reason=f"timed out after {timeout_s:g} s")
    try:
        report = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        report = None
    if not isinstance(report, dict):
        why = ("more than one report, or a garbled one, reached the report channel" if raw else
               "the candidate replaced the report channel (the harness found another file at its number)"
               if returncode == 5 else f"the process ended (exit status {returncode}) before the tests reported")
        return None, replace(facts, reason=why)
    if report.get("nonce") != nonce:
        return None, replace(facts, reason="a report without the run's nonce reached the report channel (forged)")
    if not echoed or returncode != 0:
        return None, replace(facts, reason=f"the process ended (exit status {returncode}) before the harness returned")
    return report, facts


def run_unittest(program: str, tests: str, *, env: LibraryEnv | None = None, timeout_s: float = 240.0,
                 memory_mb: int = 30 * 1024, unsafe_exec: bool = False, max_processes: int = 64,
                 output_limit_bytes: int = 16 << 20, isolation: str | None = None) -> UnittestResult:
    """Run ``program + "\\n" + tests`` as module ``__test__`` and its ``TestCases`` in the sandbox.

    Args:
        program: the candidate program (BigCodeBench: the prompt's imports and the completed function).
        tests: the benchmark's test module text, defining ``class TestCases(unittest.TestCase)``.
        env: whose libraries the code imports (default :func:`library_env` of this interpreter).
        timeout_s: wall-clock limit of the whole run (official BigCodeBench: 240 s per task).
        memory_mb: address-space limit (official: 30 GiB).
        unsafe_exec, isolation: as in :func:`~dlm_toolkit.tasks.sandbox.run_python`.
        max_processes, output_limit_bytes: process count and largest file (captured output included).

    Returns:
        An :class:`UnittestResult`; never raises for anything the code does.

    Raises:
        SandboxUnavailable: bubblewrap is needed and cannot run here.
        ValueError: a bad limit.
    """
    env = env or library_env()
    static = static_test_facts(tests)
    payload = {"mode": "unittest", "program": program, "tests": tests, "binds": list(env.binds), "static": static}
    report, facts = _run(payload, env=env, timeout_s=timeout_s, memory_mb=memory_mb, unsafe_exec=unsafe_exec,
                         max_processes=max_processes, output_limit_bytes=output_limit_bytes, isolation=isolation)
    if report is None:
        return facts
    failed, tests_run, ok = report.get("failed"), report.get("tests"), report.get("ok")
    if (report.get("status") not in ("pass", "fail") or not isinstance(failed, dict) or not isinstance(ok, list)
            or not isinstance(tests_run, int) or not isinstance(report.get("reason"), str)):
        return replace(facts, reason="the report does not follow the harness's format")
    failed = {str(k): str(v) for k, v in failed.items()}
    unseen = sorted(set(static["tests"]) - {str(name) for name in ok})
    passed = report["status"] == "pass" and not failed and tests_run > 0 and not unseen
    reason = "" if passed else report["reason"] or (
        f"the report leaves out {len(unseen)} test(s) the module defines: {', '.join(unseen[:20])}" if unseen
        else "no test ran")
    if failed:
        first = next(iter(sorted(failed)))
        reason += f" ({first}: {failed[first].strip().splitlines()[-1][:300] if failed[first].strip() else ''})"
    return replace(facts, passed=passed, reason=reason, tests_run=tests_run, failed=failed)


def probe_modules(names: list[str] | tuple[str, ...], *, env: LibraryEnv | None = None, unsafe_exec: bool = False,
                  isolation: str | None = None, timeout_s: float = 60.0) -> dict[str, bool]:
    """Which of the top-level module ``names`` the sandboxed interpreter finds
    (``importlib.util.find_spec``, nothing imported), with ``env``'s libraries visible as for
    :func:`run_unittest`.

    Raises:
        RuntimeError: the probe itself did not report (the sandbox is broken here).
    """
    env = env or library_env()
    payload = {"mode": "probe", "modules": sorted(set(names)), "binds": list(env.binds)}
    report, facts = _run(payload, env=env, timeout_s=timeout_s, memory_mb=4096, unsafe_exec=unsafe_exec,
                         max_processes=16, output_limit_bytes=1 << 20, isolation=isolation)
    found = report.get("found") if report else None
    if not isinstance(found, dict):
        raise RuntimeError(f"the module probe in the sandbox failed: {facts.reason} {facts.stderr_tail[-300:]}")
    return {name: found.get(name) is True for name in names}


def top_level_imports(*sources: str) -> set[str]:
    """Top-level names of the modules ``sources`` import (``import a.b`` -> ``a``; relative imports
    skipped); a source that does not parse contributes nothing."""
    import ast

    names: set[str] = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    names.discard("__future__")
    return names
