"""A plug-in step hook written only from README's hook paragraph ("Write a strategy"): a T2T rule that
asks for a hook freezing the first position of the active block (never edited, never remasked once
written), checked with the contract suite the README gives (StepHookContract), plus the hook machinery
itself (dlm_toolkit.hooks): stages collected once, bound budgets added, refusals at policy build."""

from __future__ import annotations

import torch

import pytest

from dlm_toolkit import T2T, ConfigError, DecodingPolicy, decode
from dlm_toolkit.hooks import Declaration, HookStages, StepHook
from dlm_toolkit.testing import StepHookContract, tiny_llada2
from strategies.t2t_threshold import ThresholdEdit

BL = 8


class FreezeFirst(StepHook):
    """After the rules: no edit or remask at the first position of the active block."""

    def after_rules(self, ctx, engine, state):
        first = ctx.in_block & ~torch.cat([torch.zeros_like(ctx.in_block[:, :1]), ctx.in_block[:, :-1]], 1)
        ctx.edit = ctx.edit & ~first
        ctx.remask = ctx.remask & ~first


class FreezeFirstThreshold(ThresholdEdit):
    """The threshold edit rule with the freeze hook."""

    def step_hooks(self, policy, role):
        return [FreezeFirst()]


class _NotAHook(ThresholdEdit):
    def step_hooks(self, policy, role):
        return ["freeze"]


class _Refuses(StepHook):
    def declare(self, policy):
        if policy.remask.name == "none":
            raise ConfigError("hook 'refuses': needs a remask rule")
        return Declaration()


class _RefusingRule(ThresholdEdit):
    def step_hooks(self, policy, role):
        return [_Refuses()]


def registered(cls, name):
    if name not in T2T.names():  # registered now, not at import: other files list the registered rules
        T2T.register(name)(cls)
    return name


def policy(t2t: str) -> DecodingPolicy:
    # edits readily (threshold 0): without the hook some edits land on a block's first position
    return DecodingPolicy("llada2.1-q", **{"t2t.name": t2t, "t2t.params.threshold": 0.0,
                                           "blocks.params.block_length": BL})


PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def first_edits(result) -> list[int]:
    """Edits (and remasks) at a generated block start (absolute position a multiple of BL: the
    semi_ar grid starts at 0)."""
    return [p for s in result.trajectory.steps for p in s.edit + s.remask if p % BL == 0]


class TestFreezeFirst(StepHookContract):
    """The README's contract suite for the hook: collected, no state, batch = alone (temperature 0 and 1),
    KV cache on = off, check_every 1 = 3, compiled = eager, forward budget, near miss without it."""

    hook_type = FreezeFirst
    prompts = PROMPTS

    def policy_config(self):
        return policy(registered(FreezeFirstThreshold, "_freeze_first_threshold")).config

    def baseline_config(self):
        return policy("threshold").config


def test_the_freeze_hook_keeps_block_starts():
    model = tiny_llada2(seed=2)
    frozen = policy(registered(FreezeFirstThreshold, "_freeze_first_threshold"))
    got = decode(model, PROMPTS, frozen, 24, record=True)
    # near miss: the same edits without the hook do touch block starts (else this test checks nothing)
    plain = decode(model, PROMPTS, policy("threshold"), 24, record=True)
    assert first_edits(plain), "no edit at a block start without the hook: pick another seed"
    assert first_edits(got) == []


def test_a_rule_whose_step_hooks_are_not_hooks_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"t2t rule '_not_a_hook': step_hooks\(\) must return StepHook objects, got str"):
        policy(registered(_NotAHook, "_not_a_hook"))


def test_a_hook_refuses_a_policy_when_it_is_built():
    name = registered(_RefusingRule, "_refusing_hook")
    with pytest.raises(ConfigError, match="needs a remask rule"):
        policy(name)
    ok = DecodingPolicy("llada2.1-q", **{"t2t.name": name, "remask.name": "low_confidence"})  # near miss
    assert [type(h) for h in ok.hooks] == [_Refuses]


def test_stages_hold_only_the_overridden_ones_and_a_plain_policy_has_none():
    assert DecodingPolicy("llada2.1-q").hooks == ()
    stages = HookStages([FreezeFirst(), _Refuses()])
    assert len(stages.after_rules) == 1 and stages.after_forward == [] and stages.after_write == []
    assert stages.step_segments == []


def test_forward_budgets_add_to_the_schedule_bound():
    # llada2.1-q: blocks of 32, up to 16 post steps -> 32 + 16 = 48 forwards per block (semi_ar);
    # s2d2 verifies at most once per position (+32); indel deletes only in a block's first 16 forwards (+16)
    assert DecodingPolicy("llada2.1-q").forward_limit() == 48
    both = DecodingPolicy("llada2.1-q", **{"m2t.name": "s2d2", "t2t.name": "indel"})
    assert both.forward_limit() == 48 + 32 + 16
    assert DecodingPolicy("llada2.1-q", **{"t2t.name": "indel", "t2t.params.indel_steps": 3}).forward_limit() == 51
    shadow = DecodingPolicy("llada2.1-q", **{"m2t.name": "wino", "remask.name": "wino_shadow"})
    assert shadow.forward_limit() == 48 and type(shadow.hooks[0]).step_segments is not StepHook.step_segments


def test_two_rules_reading_the_shadow_block_share_one_hook_named_after_the_first():
    from dlm_toolkit import M2T
    from dlm_toolkit.hooks.shadow import Shadow, ShadowHook
    from strategies.wino import WinoWideIn

    class _ShadowWideIn(WinoWideIn, Shadow):
        pass

    if "_shadow_wide_in" not in M2T.names():
        M2T.register("_shadow_wide_in")(_ShadowWideIn)
    both = DecodingPolicy("llada2.1-q", **{"m2t.name": "_shadow_wide_in", "remask.name": "wino_shadow"})
    assert [(type(h), h.name) for h in both.hooks] == [(ShadowHook, "m2t rule '_shadow_wide_in'")]
    one = DecodingPolicy("llada2.1-q", **{"m2t.name": "wino", "remask.name": "wino_shadow"})  # near miss
    assert [h.name for h in one.hooks] == ["remask rule 'wino_shadow'"]


def test_the_readme_hook_example_passes_its_contract_suite():
    """README's whole hook example, run as written: its suite's checks pass (compiled = eager and the
    temperature-1 batch check run above on the same hook, TestFreezeFirst)."""
    import re
    from pathlib import Path

    from dlm_toolkit.strategy.registry import REGISTRIES

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.+?)```", readme, re.S)
    [hook] = [b for b in blocks if "class FreezeFirst(StepHook)" in b]
    [suite] = [b for b in blocks if "(StepHookContract)" in b]
    space: dict = {"__name__": "readme_hook_example"}
    try:
        exec(compile(hook, "README.md", "exec"), space)  # the suite block runs after it, in its namespace
        exec(compile(suite, "README.md", "exec"), space)
        suite = space["TestFreezeFirst"]()
        assert [type(h) for h in suite.make_policy().hooks] == [space["FreezeFirst"]]
        for check in ("test_hook_is_collected_and_valid", "test_keeps_no_state", "test_kv_cache_and_check_every_invariant",
                      "test_declared_outputs_are_set_as_declared", "test_forward_budget_holds_and_counters_recount",
                      "test_near_miss_without_the_hook"):
            getattr(suite, check)()
        suite.test_batch_invariant(0.0)
    finally:
        REGISTRIES["t2t"]._entries.pop("freeze_first", None)  # other files list the registered rules
