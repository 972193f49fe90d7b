"""A contract failure names the plug-in's own line, not only the toolkit's (issue 45 item 7).

A plug-in module and its test file are written into a scratch folder and run by pytest in this
process with the toolkit's pytest plug-in. Two failures: a rule whose selections break the role's
contract (no frame of the plug-in is running when the suite finds it: the report names the rule's
class definition) and a hook whose stage writes an output it never declared (the report names the
stage's line that wrote it).
"""

from __future__ import annotations

pytest_plugins = ["pytester"]

PLUGIN = '''import torch
from dlm_toolkit import T2T, UnmaskRule
from dlm_toolkit.hooks import StepHook


class EveryPosition(UnmaskRule):
    def __call__(self, ctx):
        return torch.ones_like(ctx.tokens, dtype=torch.bool)


class Undeclared(StepHook):
    def after_rules(self, ctx, engine, state):
        x = ctx.commit
        ctx.hooks.not_declared = x


@T2T.register("_report_lines_undeclared")
class UndeclaredEdit(T2T.get("threshold")):
    def step_hooks(self, policy, role):
        return [Undeclared()]
'''

TESTS = '''from my_plugin import EveryPosition, Undeclared
from dlm_toolkit.testing import StepHookContract, UnmaskRuleContract


class TestEveryPosition(UnmaskRuleContract):
    rule_factory = EveryPosition


class TestUndeclared(StepHookContract):
    hook_type = Undeclared

    def policy_config(self):
        return {"m2t": {"name": "threshold", "params": {"threshold": 0.7}},
                "t2t": {"name": "_report_lines_undeclared", "params": {"threshold": 0.0}},
                "blocks": {"name": "semi_ar", "params": {"block_length": 8, "max_post_steps": 4}}}
'''


def _line(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_contract_failures_name_the_plugins_line(pytester) -> None:
    from importlib.metadata import distributions

    from dlm_toolkit.strategy.registry import REGISTRIES

    installed = any(ep.group == "pytest11" and ep.name == "dlm_toolkit" for d in distributions() for ep in d.entry_points)
    plugin = () if installed else ("-p", "dlm_toolkit.testing.pytest_plugin")
    pytester.makepyfile(my_plugin=PLUGIN, test_broken=TESTS)
    pytester.syspathinsert()
    try:
        done = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", *plugin, "-k",
                                            "selection_contract or keeps_no_state")
    finally:
        REGISTRIES["t2t"]._entries.pop("_report_lines_undeclared", None)  # other files list the registered rules
    out = done.stdout.str()
    failures = out.split("short test summary info")[0]
    assert done.ret == 1 and "contract failed: EveryPosition()" in failures, out[-3000:]
    rule_def = _line(PLUGIN, "class EveryPosition")
    assert f"plug-in: my_plugin.py:{rule_def} (EveryPosition)" in failures  # no plug-in frame ran: its class
    write = _line(PLUGIN, "ctx.hooks.not_declared = x")
    assert "not_declared" in failures and f"plug-in: my_plugin.py:{write}\n" in failures  # the stage's line
    assert f"my_plugin.py:{write - 1}" not in failures  # near miss: the line before is not named
    assert failures.count("(dlm_toolkit/testing/") == failures.count("contract failed:")  # and the check's line
