"""pytest plug-in (entry point ``pytest11``): a contract suite's failure reported in one short line.

The suites of :mod:`dlm_toolkit.testing` check a plug-in author's rule with plain ``assert``s whose
messages say what broke (the rule, where, what was expected), and the decode they run refuses a rule
that breaks its role's contract with a :class:`~dlm_toolkit.decoding.policy.StrategyError` that says the
same. pytest's default report prints the source of every frame instead -- pages of the suite's and
the engine's code that the author did not write. Where a test fails on an ``AssertionError`` raised
inside the suites, or on a ``StrategyError`` while a suite runs, the report keeps the message, the
plug-in's own line (the deepest frame of the author's code in the traceback, else where the class
under test -- ``rule_factory``, ``hook_type`` -- or the test class is defined) and the suite's line.
Any other failure (the rule's own exception, the author's own tests) is reported
as pytest reports it. Loaded automatically once the toolkit is installed; ``-p
no:dlm_toolkit`` turns it off.
"""

from __future__ import annotations

import inspect
import sysconfig
from pathlib import Path
from typing import Any

import pytest

SUITES = Path(__file__).resolve().parent
TOOLKIT = SUITES.parent
# where code the author did not write lives: the toolkit, the standard library, installed packages
_NOT_AUTHORS = {TOOLKIT, *(Path(sysconfig.get_path(k)).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
MAX_MESSAGE = 2000  # characters of a message kept (a message that lists positions can be long)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Shorten the report of a contract assertion (see the module docstring)."""
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if not report.failed or excinfo is None:
        return
    from dlm_toolkit.decoding.policy import StrategyError  # here: pytest loads the plug-in in every run, torch or not

    if not excinfo.errisinstance((AssertionError, StrategyError)):
        return
    frames = [(Path(str(e.path)).resolve(), e.lineno + 1) for e in excinfo.traceback]
    in_suites = [(path, line) for path, line in frames if SUITES in path.parents]
    if not in_suites or (excinfo.errisinstance(AssertionError) and in_suites[-1] != frames[-1]):
        return  # not a contract's verdict: an assert of the author's own, or of code the suite called
    path, line = in_suites[-1]
    message = (str(excinfo.value) or "assertion failed")[:MAX_MESSAGE]
    root = Path(str(item.config.rootpath)).resolve()
    report.longrepr = (f"contract failed: {message}\n  plug-in: {plugin_line(item, frames + _cause_frames(excinfo.value), root)}\n"
                       f"  (dlm_toolkit/testing/{path.name}:{line}: the contract's check)")


def _cause_frames(err: BaseException) -> list[tuple[Path, int]]:
    """The frames of the errors ``err`` was raised from (a suite that reports a failed decode raises its
    own ``AssertionError`` from the decode's error, whose traceback holds the plug-in's stage)."""
    import traceback

    frames: list[tuple[Path, int]] = []
    seen = {id(err)}
    cause = err.__cause__ or err.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        frames = [(Path(f.f_code.co_filename).resolve(), line) for f, line in traceback.walk_tb(cause.__traceback__)]
        cause = cause.__cause__ or cause.__context__
    return frames  # the first error's: where it all began


def _under(path: Path, bases: set[Path]) -> bool:
    return any(base == path or base in path.parents for base in bases)


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if root in path.parents else str(path)


def _defined(target: Any) -> tuple[Path, int] | None:
    target = getattr(target, "__func__", target)  # a factory stored as a function on the class
    if not inspect.isclass(target) and not inspect.isfunction(target):
        return None
    try:
        return Path(inspect.getsourcefile(target) or "").resolve(), inspect.getsourcelines(target)[1]
    except (OSError, TypeError):
        return None


def plugin_line(item: pytest.Item, frames: list[tuple[Path, int]], root: Path) -> str:
    """``file:line`` of the author's code to look at: the deepest frame of it in the traceback (a stage
    or rule that was running), else the definition of the class the suite checks (``rule_factory``,
    ``hook_type``), else of the test class. The author's code is what is not the toolkit, the standard
    library or an installed package -- or is the file that defines the class under test (a plug-in
    installed as a package)."""
    cls = getattr(item, "cls", None)
    defined = [(t, d) for t in (getattr(cls, "rule_factory", None), getattr(cls, "hook_type", None), cls)
               if (d := _defined(t)) is not None and not _under(d[0], {TOOLKIT})]
    plugin_files = {d[0] for _, d in defined[:1]}
    own = [(path, line) for path, line in frames
           if path in plugin_files or (path.is_file() and not _under(path, _NOT_AUTHORS)
                                       and "_pytest" not in path.parts and "pluggy" not in path.parts)]
    if own:
        path, line = own[-1]
        return f"{_shown(path, root)}:{line}"
    if defined:
        target, (path, line) = defined[0]
        target = getattr(target, "__func__", target)
        return f"{_shown(path, root)}:{line} ({target.__qualname__})"
    return item.nodeid
