"""The step-hook contract suite (dlm_toolkit.testing.StepHookContract) run on the built-in hooks --
verification (s2d2), the shadow block (wino_shadow), insert/delete (indel), dynamic blocks (dsb) --
and shown to bite: one deliberately broken hook per check fails that check, next to the same hook
done right passing it."""

from __future__ import annotations

import pytest

from dlm_toolkit.testing import StepHookContract


def cfg(m2t=("threshold", {"threshold": 0.7}), t2t=("none", {}), remask=("none", {}),
        blocks=("semi_ar", {"block_length": 8, "max_post_steps": 4})):
    return {role: {"name": name, "params": params}
            for role, (name, params) in (("m2t", m2t), ("t2t", t2t), ("remask", remask), ("blocks", blocks))}


class TestVerifyHook(StepHookContract):
    host_reads_per_stage = 1  # an eager decode reads whether any row verifies, to skip the forward if none

    def policy_config(self):
        return cfg(m2t=("s2d2", {"threshold": 0.7}))

    def baseline_config(self):
        return cfg()


class TestShadowHook(StepHookContract):
    def policy_config(self):
        return cfg(m2t=("wino", {"threshold": 0.3}), remask=("wino_shadow", {"threshold": 0.9}))

    def baseline_config(self):
        return cfg(m2t=("wino", {"threshold": 0.3}), remask=("wino", {"threshold": 0.9}))


class TestIndelHook(StepHookContract):
    def policy_config(self):
        return cfg(t2t=("indel", {"threshold": 0.5, "delete_threshold": 0.5, "insert_threshold": 0.5,
                                  "keep_below": 0.9}))

    def baseline_config(self):
        return cfg(t2t=("threshold", {"threshold": 0.5}))


class TestDynamicBlocksHook(StepHookContract):
    def policy_config(self):
        return cfg(blocks=("dsb", {"block_length": 8}))

    def baseline_config(self):
        return cfg()


# -- the suite bites: one broken hook per check, each failing that check ------------------------------
import torch  # noqa: E402

from dlm_toolkit import T2T  # noqa: E402
from dlm_toolkit.hooks import Declaration, StepHook  # noqa: E402
from dlm_toolkit.strategy.base import Output  # noqa: E402
from strategies.t2t_threshold import ThresholdEdit  # noqa: E402

BL = 8


def first_of_block(ctx) -> torch.Tensor:
    return ctx.in_block & ~torch.cat([torch.zeros_like(ctx.in_block[:, :1]), ctx.in_block[:, :-1]], 1)


class Freeze(StepHook):
    """The README's toy hook: no edit or remask at the active block's first position."""

    def after_rules(self, ctx, engine, state):
        first = first_of_block(ctx)
        ctx.edit = ctx.edit & ~first
        ctx.remask = ctx.remask & ~first


class KeepsState(Freeze):
    def after_rules(self, ctx, engine, state):
        self.steps = getattr(self, "steps", 0) + 1
        super().after_rules(ctx, engine, state)


class CountsInPlace(Freeze):
    """Keeps a counter in a list it made when built: its __dict__ keeps the same objects."""

    def __init__(self):
        self.counts = [0]

    def after_rules(self, ctx, engine, state):
        self.counts[0] += 1
        super().after_rules(ctx, engine, state)


class HoldsConfig(Freeze):
    """Holds (and only reads) things it was built with: no per-decode state."""

    def __init__(self, blocks):
        self.blocks, self.sizes, self.table = blocks, [8], torch.arange(3)


class BatchDependent(Freeze):
    def after_rules(self, ctx, engine, state):
        if ctx.in_block.shape[0] > 1:  # freezes only in a batch
            super().after_rules(ctx, engine, state)


class CacheDependent(Freeze):
    def after_rules(self, ctx, engine, state):
        if engine.cached:  # freezes only with the KV cache
            super().after_rules(ctx, engine, state)


class MarksFrozen(Freeze):
    def declare(self, policy):
        return Declaration(outputs={"frozen": Output(("B", "W"), torch.bool)})

    def after_rules(self, ctx, engine, state):
        super().after_rules(ctx, engine, state)
        ctx.hooks.frozen = first_of_block(ctx)


class FillsItsCache(Freeze):
    """Adds to a dict and a tensor it made when built."""

    def __init__(self, what):
        self.what, self.cache, self.seen = what, {}, torch.zeros(1)

    def after_rules(self, ctx, engine, state):
        if self.what == "cache":
            self.cache[len(self.cache)] = True
        else:
            self.seen += 1
        super().after_rules(ctx, engine, state)


class RebindsObject(Freeze):
    """Swaps an object it holds for the step's context: same attribute names, another object."""

    def __init__(self):
        self.last = object()

    def after_rules(self, ctx, engine, state):
        self.last = ctx
        super().after_rules(ctx, engine, state)


class CountsFrozen(Freeze):
    def declare(self, policy):
        return Declaration(outputs={"frozen_per_row": Output((), int)})

    def after_rules(self, ctx, engine, state):
        super().after_rules(ctx, engine, state)
        ctx.hooks.frozen_per_row = 1


class CountsFrozenAsFloat(CountsFrozen):
    def after_rules(self, ctx, engine, state):
        Freeze.after_rules(self, ctx, engine, state)
        ctx.hooks.frozen_per_row = 1.0  # declared int


class MarksFrozenAsFloat(MarksFrozen):
    def after_rules(self, ctx, engine, state):
        Freeze.after_rules(self, ctx, engine, state)
        ctx.hooks.frozen = first_of_block(ctx).float()  # declared bool


class NeverMarks(MarksFrozen):
    def after_rules(self, ctx, engine, state):
        Freeze.after_rules(self, ctx, engine, state)  # declares 'frozen', never sets it


class ExtraForwards(Freeze):
    """Freezes, and runs two forwards of the step's window of its own every step."""

    def __init__(self, blocks, budget):
        self.blocks, self.budget = blocks, budget

    def declare(self, policy):
        return Declaration(forward_budget=self.budget)

    def after_rules(self, ctx, engine, state):
        super().after_rules(ctx, engine, state)
        lo, hi = self.blocks.window(state, state.all_rows)
        window, _, _ = engine.window(ctx.live, lo, hi)
        for _ in range(2):
            engine.extra_forward([window], ctx.live)


class HostRead(Freeze):
    def after_rules(self, ctx, engine, state):
        if ctx.edit.any():  # a host read each step
            super().after_rules(ctx, engine, state)


class LateFreeze(StepHook):
    """Narrows the edits after the write: the canvas holds them, the recorded steps do not."""

    def after_write(self, ctx, state):
        ctx.edit = ctx.edit & ~first_of_block(ctx)


class Inert(StepHook):
    def after_rules(self, ctx, engine, state):
        ctx.edit = ctx.edit & ~ctx.is_prompt  # the rules never edit the prompt: changes nothing


HOOKS = {"freeze": lambda policy: Freeze(), "keeps_state": lambda policy: KeepsState(),
         "batch_dependent": lambda policy: BatchDependent(),
         "counts_in_place": lambda policy: CountsInPlace(), "rebinds": lambda policy: RebindsObject(),
         "fills_cache": lambda policy: FillsItsCache("cache"), "counts_in_tensor": lambda policy: FillsItsCache("seen"),
         "counts": lambda policy: CountsFrozen(), "counts_float": lambda policy: CountsFrozenAsFloat(), "holds_config": lambda policy: HoldsConfig(policy.blocks), "cache_dependent": lambda policy: CacheDependent(),
         "marks": lambda policy: MarksFrozen(), "marks_float": lambda policy: MarksFrozenAsFloat(),
         "never_marks": lambda policy: NeverMarks(), "inert": lambda policy: Inert(),
         "host_read": lambda policy: HostRead(), "late_freeze": lambda policy: LateFreeze(),
         # the schedule's bound is 8 + 4 = 12 forwards per block; each step takes 3
         "over_budget": lambda policy: ExtraForwards(policy.blocks, 0),
         "within_budget": lambda policy: ExtraForwards(policy.blocks, 2 * 12)}


def hooked_rule(kind: str) -> str:
    name = f"_contract_{kind}"
    if name not in T2T.names():  # registered now, not at import: other files list the registered rules
        class Rule(ThresholdEdit):
            def step_hooks(self, policy, role):
                return [HOOKS[kind](policy)]

        T2T.register(name)(Rule)
    return name


def suite(kind: str) -> StepHookContract:
    class Suite(StepHookContract):
        def policy_config(self):  # edits readily (threshold 0): without the hook some land on a block start
            return cfg(t2t=(hooked_rule(kind), {"threshold": 0.0}))

        def baseline_config(self):
            return cfg(t2t=("threshold", {"threshold": 0.0}))

    return Suite()


def test_the_right_hooks_pass_the_checks_their_broken_twins_fail():
    suite("freeze").test_keeps_no_state()
    suite("holds_config").test_keeps_no_state()
    suite("freeze").test_batch_invariant(1.0)
    suite("freeze").test_kv_cache_and_check_every_invariant()
    suite("freeze").test_near_miss_without_the_hook()
    suite("within_budget").test_reads_nothing_on_the_host()  # extra forwards read nothing
    allowed = suite("host_read")
    allowed.host_reads_per_stage = 1  # one read per call allowed: passes; two would not
    allowed.test_reads_nothing_on_the_host()
    suite("marks").test_declared_outputs_are_set_as_declared()
    suite("counts").test_declared_outputs_are_set_as_declared()
    suite("within_budget").test_forward_budget_holds_and_counters_recount()


@pytest.mark.parametrize("kind, check, message", [
    ("keeps_state", "test_keeps_no_state", r"KeepsState' changed its attributes \['steps'\] in a decode"),
    ("counts_in_place", "test_keeps_no_state", r"CountsInPlace' changed its attributes \['counts'\] in a decode"),
    ("rebinds", "test_keeps_no_state", r"RebindsObject' changed its attributes \['last'\] in a decode"),
    ("fills_cache", "test_keeps_no_state", r"FillsItsCache' changed its attributes \['cache'\] in a decode"),
    ("counts_in_tensor", "test_keeps_no_state", r"FillsItsCache' changed its attributes \['seen'\] in a decode"),
    ("batch_dependent", "test_batch_invariant", r"BatchDependent': row \d decodes differently alone than in a batch of 3 \(temperature 0.0\)"),
    ("cache_dependent", "test_kv_cache_and_check_every_invariant", r"CacheDependent': the decode with kv_cache=False differs"),
    ("marks_float", "test_declared_outputs_are_set_as_declared",
     r"MarksFrozenAsFloat': output 'frozen' must be a \(3, \d+\) torch.bool tensor \(B, W\), got a \(3, \d+\) torch.float32 tensor"),
    ("counts_float", "test_declared_outputs_are_set_as_declared",
     r"CountsFrozenAsFloat': output 'frozen_per_row' must be a Python int, got a float"),
    ("never_marks", "test_declared_outputs_are_set_as_declared", r"NeverMarks' declares outputs \['frozen'\] but never set them"),
    ("over_budget", "test_forward_budget_holds_and_counters_recount",
     r"ExtraForwards': the decode failed: block schedule 'semi_ar' exceeded 12 forwards in one block"),
    ("host_read", "test_reads_nothing_on_the_host",
     r"HostRead' read the device from the host \d+ times in a decode \(aten.is_nonzero.default x\d+; allowed: 0\)"),
    ("late_freeze", "test_forward_budget_holds_and_counters_recount",
     r"LateFreeze': the decode failed: step hook 'LateFreeze' replaced ctx.edit in after_write, after the step wrote it"),
    ("inert", "test_near_miss_without_the_hook", r"Inert' is inert on the contract's prompts"),
])
def test_a_broken_hook_fails_the_matching_check(kind, check, message):
    method = getattr(suite(kind), check)
    with pytest.raises(AssertionError, match=rf"^step hook '{message}"):
        method(0.0) if check == "test_batch_invariant" else method()


def test_the_suite_recounts_forwards_per_block_itself(monkeypatch):
    """With the engine's own per-block bound lifted, the suite's recount still finds the hook that runs
    3 forwards a step over a bound of 12 (8 positions + 4 post steps) with no budget declared."""
    from dlm_toolkit.decoding import loop

    checks = loop.StepChecks
    monkeypatch.setattr(loop, "StepChecks", lambda policy, limit: checks(policy, 10_000))
    with pytest.raises(AssertionError, match=r"^step hook 'ExtraForwards': row \d took (1[3-9]|[2-9]\d|\d{3}) forwards "
                       r"in block \d+, over the schedule's bound 12 \+ the declared budget 0"):
        suite("over_budget").test_forward_budget_holds_and_counters_recount()
    suite("within_budget").test_forward_budget_holds_and_counters_recount()  # near miss: declared


pytest_plugins = ["pytester"]  # a broken plug-in hook's test file run by pytest in this process

BROKEN = '''import torch
from dlm_toolkit import T2T
from dlm_toolkit.hooks import Declaration, StepHook
from dlm_toolkit.testing import StepHookContract


class Counting(StepHook):
    def after_rules(self, ctx, engine, state):
        self.steps = getattr(self, "steps", 0) + 1


@T2T.register("_reporting_counting")
class CountingEdit(T2T.get("threshold")):
    def step_hooks(self, policy, role):
        return [Counting()]


class TestCounting(StepHookContract):
    def policy_config(self):
        return {"m2t": {"name": "threshold", "params": {"threshold": 0.7}},
                "t2t": {"name": "_reporting_counting", "params": {"threshold": 0.0}},
                "blocks": {"name": "semi_ar", "params": {"block_length": 8, "max_post_steps": 4}}}
'''


def test_a_broken_hook_is_reported_in_one_line(pytester):
    from importlib.metadata import distributions

    from dlm_toolkit.strategy.registry import REGISTRIES

    # as pytest looks for it (every distribution: an editable install may leave a second metadata folder)
    installed = any(ep.group == "pytest11" and ep.name == "dlm_toolkit" for d in distributions() for ep in d.entry_points)
    plugin = () if installed else ("-p", "dlm_toolkit.testing.pytest_plugin")  # not yet reinstalled: by name
    pytester.makepyfile(test_broken_hook=BROKEN)
    try:
        done = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", *plugin, "-k", "keeps_no_state or kv_cache")
    finally:
        REGISTRIES["t2t"]._entries.pop("_reporting_counting", None)  # other files list the registered rules
    out = done.stdout.str()
    assert done.ret == 1 and "1 failed, 1 passed" in out, out[-3000:]
    failures = out.split("short test summary info")[0]
    assert "contract failed: step hook 'Counting' changed its attributes ['steps'] in a decode" in failures
    assert "(dlm_toolkit/testing/contracts_hooks.py:" in failures
    assert "def " not in failures and len(failures.splitlines()) < 10


def test_the_suite_sets_the_temperature_it_says():
    assert suite("freeze").make_policy(**{"sampling.temperature": 1.0}).sampling.temperature == 1.0


class Uncapturable(Freeze):
    capturable = False  # the hook's own opt-out of compiled = eager


HOOKS["uncapturable"] = lambda policy: Uncapturable()


def test_compiled_equals_eager_is_opted_out_by_the_suite_or_the_hook_only():
    opted = suite("freeze")
    opted.capturable = False
    for skipped in (opted, suite("uncapturable")):
        with pytest.raises(pytest.skip.Exception, match="capturable = False"):
            skipped.test_compiled_equals_eager()


def test_the_hook_must_be_in_the_policy_and_of_the_named_class():
    plain = suite("freeze")
    plain.policy_config = lambda: cfg()  # no rule asks for a hook
    with pytest.raises(AssertionError, match="the policy has no step hook"):
        plain.test_hook_is_collected_and_valid()
    wrong = suite("freeze")
    wrong.hook_type = KeepsState
    with pytest.raises(AssertionError, match=r"policy.hooks holds \['Freeze'\], not KeepsState"):
        wrong.test_hook_is_collected_and_valid()
    right = suite("freeze")
    right.hook_type = Freeze
    right.test_hook_is_collected_and_valid()


def test_without_a_baseline_the_near_miss_drops_the_hooks():
    active, inert = suite("freeze"), suite("inert")
    for dropped in (active, inert):
        dropped.baseline_config = lambda: None
        assert dropped.make_baseline().hooks == () and dropped.make_policy().hooks != ()
    active.test_near_miss_without_the_hook()
    with pytest.raises(AssertionError, match="is inert on the contract's prompts"):
        inert.test_near_miss_without_the_hook()
