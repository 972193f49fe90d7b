"""pytest plug-in (entry point ``pytest11``): a contract suite's failure reported in one short line.

The suites of :mod:`dlm_toolkit.testing` check a plug-in author's rule with plain ``assert``s whose
messages say what broke (the rule, where, what was expected), and the decode they run refuses a rule
that breaks its role's contract with a :class:`~dlm_toolkit.strategy.policy.StrategyError` that says the
same. pytest's default report prints the source of every frame instead -- pages of the suite's and
the engine's code that the author did not write. Where a test fails on an ``AssertionError`` raised
inside the suites, or on a ``StrategyError`` while a suite runs, the report keeps the message and
the suite's line. Any other failure (the rule's own exception, the author's own tests) is reported
as pytest reports it. Loaded automatically once the toolkit is installed; ``-p
no:dlm_toolkit`` turns it off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SUITES = Path(__file__).resolve().parent
MAX_MESSAGE = 2000  # characters of a message kept (a message that lists positions can be long)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """Shorten the report of a contract assertion (see the module docstring)."""
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if not report.failed or excinfo is None:
        return
    from dlm_toolkit.strategy.policy import StrategyError  # here: pytest loads the plug-in in every run, torch or not

    if not excinfo.errisinstance((AssertionError, StrategyError)):
        return
    frames = [(Path(str(e.path)).resolve(), e.lineno + 1) for e in excinfo.traceback]
    in_suites = [(path, line) for path, line in frames if SUITES in path.parents]
    if not in_suites or (excinfo.errisinstance(AssertionError) and in_suites[-1] != frames[-1]):
        return  # not a contract's verdict: an assert of the author's own, or of code the suite called
    path, line = in_suites[-1]
    message = (str(excinfo.value) or "assertion failed")[:MAX_MESSAGE]
    report.longrepr = f"contract failed: {message}\n  (dlm_toolkit/testing/{path.name}:{line})"
