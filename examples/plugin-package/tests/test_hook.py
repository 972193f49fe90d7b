"""The example hook against the toolkit's step-hook contract suite, plus its parameter's path from a policy."""

from dlm_example_plugin.hooks import FreezeFirst

from dlm_toolkit import DecodingPolicy
from dlm_toolkit.testing import StepHookContract

POLICY = {"m2t": {"name": "threshold", "params": {"threshold": 0.7}},
          "t2t": {"name": "freeze_first", "params": {"threshold": 0.0, "frozen": 2}},
          "blocks": {"name": "semi_ar", "params": {"block_length": 8, "max_post_steps": 4}}}


class TestFreezeFirst(StepHookContract):
    hook_type = FreezeFirst

    def policy_config(self):
        return POLICY

    def baseline_config(self):  # the near miss: the same edits, nothing frozen
        return {**POLICY, "t2t": {"name": "threshold", "params": {"threshold": 0.0}}}


def test_the_parameter_reaches_the_hook_from_the_policy():
    [hook] = DecodingPolicy(POLICY).hooks
    assert isinstance(hook, FreezeFirst) and hook.frozen == 2
    [hook] = DecodingPolicy(POLICY, **{"t2t.params.frozen": 5}).hooks  # --set t2t.params.frozen=5
    assert hook.frozen == 5
