"""Every built-in strategy through the contract suites that plug-in authors subclass."""

import pytest
import torch

from dlm_toolkit import EditRule, RemaskRule, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.registry import BLOCKS, M2T, REMASK, T2T
from dlm_toolkit.strategy.selection import top1
from dlm_toolkit.testing import (BlockScheduleContract, DynamicBlockScheduleContract, EditRuleContract, RemaskRuleContract,
                                 IndelContract, UnmaskRuleContract, VerifierContract)

# -- m2t -------------------------------------------------------------------------------------


class TestThreshold(UnmaskRuleContract):
    rule_factory = M2T.get("threshold")
    configs = [{}, {"threshold": 0.3}, {"threshold": 1.0}]


class TestTopK(UnmaskRuleContract):
    rule_factory = M2T.get("topk")
    configs = [{"steps_per_block": 4}, {"steps_per_block": 2, "schedule": "cosine"}, {"steps_per_block": 3, "ranking": "random"}]

    def is_random(self, rule):
        return rule.config.ranking == "random"


class TestFactor(UnmaskRuleContract):
    rule_factory = M2T.get("factor")
    configs = [{}, {"factor": 0.2}, {"factor": 8.0}]


class TestMargin(UnmaskRuleContract):
    rule_factory = M2T.get("margin")
    configs = [{"steps_per_block": 4}, {"steps_per_block": 8, "schedule": "cosine", "threshold": 0.5}]


class TestEntropy(UnmaskRuleContract):
    rule_factory = M2T.get("entropy")
    configs = [{"steps_per_block": 4}, {"steps_per_block": 8, "threshold": 0.5}]


class TestEntropyBound(UnmaskRuleContract):
    rule_factory = M2T.get("entropy_bound")
    configs = [{}, {"gamma": 2.0, "proxy": "confidence"}, {"gamma": 0.0, "proxy": "margin"}]


class TestKlass(UnmaskRuleContract):
    rule_factory = M2T.get("klass")
    configs = [{}, {"threshold": 0.3, "kl_threshold": 0.05, "history": 1}]


class TestHierarchy(UnmaskRuleContract):
    rule_factory = M2T.get("hierarchy")
    configs = [{}, {"threshold": 0.6, "low_threshold": 0.0}]


class TestCredit(UnmaskRuleContract):
    rule_factory = M2T.get("credit")
    configs = [{}, {"threshold": 0.5, "alpha": 2.0, "beta": 0.5}]


class TestAncestral(UnmaskRuleContract):
    rule_factory = M2T.get("ancestral")
    configs = [{"steps_per_block": 4}, {"steps_per_block": 1}]
    uses_randomness = True


class TestWinoWideIn(UnmaskRuleContract):
    rule_factory = M2T.get("wino")
    configs = [{}, {"threshold": 0.3}]


class TestDUS(UnmaskRuleContract):
    rule_factory = M2T.get("dus")
    configs = [{}, {"base": 3}]


class TestPCSampler(UnmaskRuleContract):
    rule_factory = M2T.get("pc_sampler")
    configs = [{"steps_per_block": 4}, {"steps_per_block": 2, "lam": 0.0, "epsilon": 0.5, "schedule": "cosine"}]


class TestLearned(UnmaskRuleContract):
    rule_factory = M2T.get("learned")
    configs = [{}, {"threshold": 0.9}]


class TestReference(UnmaskRuleContract):
    """The oracle's reference rule; its decodes run a scripted model that exposes a joint (each more
    position drawn keeps consistency with probability 0.9), as the rule's hook needs (tests/test_oracle_reference.py
    checks it on the real oracles)."""

    rule_factory = M2T.get("reference")
    configs = [{"eps": 0.2}, {"eps": 0.0}, {"eps": 1.0}]

    def _decode(self, rule, seed, prompts, gen_length, attention="block_causal", policy=None, streams=None,
                default_device=None):
        import contextlib

        from dlm_toolkit.decoding.loop import decode
        from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits

        model = _with_joint(ScriptedLM)(mixing_logits(24, seed=seed, scale=2.5, mix=2.0), 24, 23, 22, attention=attention)
        policy = policy or self.policy_for(rule)
        with torch.device(default_device) if default_device else contextlib.nullcontext():
            return decode(model, prompts, policy, gen_length, seed=streams if streams is not None else seed)

    def test_capture_safe(self, monkeypatch):
        from dlm_toolkit.testing import contracts_capture

        monkeypatch.setattr(contracts_capture, "_UncountedLM", _with_joint(contracts_capture._UncountedLM))
        super().test_capture_safe()


def _with_joint(base):
    """``base`` (a scripted model class) with a joint: each more position drawn stays consistent w.p. 0.9."""

    class WithJoint(base):
        def joint_consistency(self, canvas, orders):
            return [0.9 ** torch.arange(1, len(o) + 1, device=canvas.device, dtype=torch.float64) for o in orders]

    return WithJoint


# -- t2t -------------------------------------------------------------------------------------


class TestNoEdit(EditRuleContract):
    rule_factory = T2T.get("none")


class TestThresholdEdit(EditRuleContract):
    rule_factory = T2T.get("threshold")
    configs = [{}, {"threshold": 0.0}]


class TestMarginEdit(EditRuleContract):
    rule_factory = T2T.get("margin")
    configs = [{}, {"delta": 0.0}]


# -- remask ----------------------------------------------------------------------------------


class TestNoRemask(RemaskRuleContract):
    rule_factory = REMASK.get("none")


class TestLowConfidenceRemask(RemaskRuleContract):
    rule_factory = REMASK.get("low_confidence")
    configs = [{}, {"threshold": 0.5}]


class TestReMDM(RemaskRuleContract):
    rule_factory = REMASK.get("remdm")
    configs = [{"eta": 0.5}, {"schedule": "rescale", "eta": 1.0}, {"schedule": "conf"}]
    uses_randomness = True


class TestWinoNarrowOut(RemaskRuleContract):
    rule_factory = REMASK.get("wino")
    configs = [{}, {"threshold": 0.5}]


class TestWinoShadowNarrowOut(RemaskRuleContract):  # reads ctx.shadow_confidence (the cases carry one)
    rule_factory = REMASK.get("wino_shadow")
    configs = [{}, {"threshold": 0.5}]


class TestT2MRemask(RemaskRuleContract):
    rule_factory = REMASK.get("t2m")
    configs = [{}, {"drop": 1.0, "floor": 1.0, "min_age": 0}]


# -- blocks ----------------------------------------------------------------------------------


class TestSemiAR(BlockScheduleContract):
    rule_factory = BLOCKS.get("semi_ar")
    configs = [{"block_length": 4, "max_post_steps": 2}, {"block_length": 3, "max_post_steps": 0, "align": "prompt", "eos_early_stop": False}]


if "multi_block_edit" in BLOCKS.names():

    class TestMultiBlockEdit(BlockScheduleContract):
        rule_factory = BLOCKS.get("multi_block_edit")
        configs = [{"block_length": 4, "max_post_steps": 2, "edit_blocks": 1}, {"block_length": 3, "edit_blocks": 2}]


class TestDSB(DynamicBlockScheduleContract):
    rule_factory = BLOCKS.get("dsb")
    configs = [{"block_length": 4, "max_block_length": 8, "max_post_steps": 2},
               {"block_length": 3, "max_block_length": 3, "max_post_steps": 0, "eos_early_stop": False}]


def test_every_builtin_is_covered():
    covered = {
        (cls.role, cls.rule_factory.registered_name)
        for cls in globals().values()
        if isinstance(cls, type) and cls.__name__.startswith("Test") and getattr(cls, "rule_factory", None)
    }
    from dlm_toolkit.strategy.registry import REGISTRIES

    builtin = {(role, e.name) for role, reg in REGISTRIES.items() for e in reg.entries() if e.source == "built-in"}
    assert builtin <= covered, f"built-in strategies without a contract test: {sorted(builtin - covered)}"


def test_at_least_ten_commit_rules():
    assert len([e for e in M2T.entries() if e.source == "built-in"]) >= 10


@pytest.mark.parametrize("name", ["UnmaskRuleContract", "EditRuleContract", "RemaskRuleContract", "BlockScheduleContract"])
def test_suites_are_not_collected_themselves(name):
    assert not name.startswith("Test")


# -- the suites catch broken rules -------------------------------------------------------------

class _NoFallback(UnmaskRule):
    def __call__(self, ctx):
        return ctx.fillable & (ctx.confidence > 0.5)


class _CommitsPrompt(UnmaskRule):
    def __call__(self, ctx):
        return top1(ctx.confidence, ctx.fillable) | ctx.is_prompt


class _BatchCoupled(UnmaskRule):  # normalises by the batch-wide maximum
    def __call__(self, ctx):
        score = ctx.confidence / ctx.confidence[ctx.fillable].max().clamp(min=1e-9) if ctx.fillable.any() else ctx.confidence
        return (ctx.fillable & (score > 0.8)) | top1(ctx.confidence, ctx.fillable)


class _SecretlyRandom(UnmaskRule):
    def __call__(self, ctx):
        return top1(ctx.rand(), ctx.fillable)


class _OneStreamForAll(UnmaskRule):  # draws every row's numbers from a stream keyed by the first row's seed
    def __call__(self, ctx):
        gen = torch.Generator(device=ctx.device).manual_seed(int(ctx.seeds[0]))
        return top1(torch.rand(ctx.confidence.shape, generator=gen, device=ctx.device), ctx.fillable)


class _CommitsOutsideBlock(UnmaskRule):  # commits masks anywhere in the window
    def __call__(self, ctx):
        return top1(ctx.confidence, ctx.fillable) | (ctx.masked & ~ctx.in_block)


class _AllocatesOnDefaultDevice(UnmaskRule):
    def __call__(self, ctx):
        none = torch.zeros(ctx.batch_size, ctx.width, dtype=torch.bool)  # no device=: the CPU by default
        return top1(ctx.confidence, ctx.fillable) | none


class _SelectsPadding(EditRule):  # edits written positions outside the window too
    def __call__(self, ctx):
        return ctx.editable | (~ctx.valid & (ctx.tokens != ctx.mask_token_id))


class _Stateful(UnmaskRule):
    def __call__(self, ctx):
        self.calls = getattr(self, "calls", 0) + 1
        return top1(ctx.confidence, ctx.fillable)


class _EditsMasks(EditRule):
    def __call__(self, ctx):
        return ctx.masked | ctx.editable


class _GreedyRemask(RemaskRule):
    def __call__(self, ctx):
        return ctx.editable & ~ctx.edit & ctx.fillable.any(1)[:, None]


class _Unbounded(UnmaskRule):
    class Config(StrategyConfig):
        threshold: float = 0.5  # no range: nothing to reject, the test skips

    def __call__(self, ctx):
        return top1(ctx.confidence, ctx.fillable)


class _CachedSeeLater(BLOCKS.get("semi_ar")):  # one group for all: cached positions would see later ones
    def attention_groups(self, state, rows, positions):
        return torch.zeros_like(positions)


def _suite(base, rule_cls):
    return type("Suite", (base,), {"rule_factory": rule_cls, "n_cases": 30})()


@pytest.mark.parametrize(
    "base, rule_cls, test",
    [
        (UnmaskRuleContract, _NoFallback, "test_selection_contract_on_random_contexts"),
        (UnmaskRuleContract, _CommitsPrompt, "test_selection_contract_on_random_contexts"),
        (UnmaskRuleContract, _BatchCoupled, "test_batch_invariance"),
        (UnmaskRuleContract, _SecretlyRandom, "test_ignores_seed_unless_random"),
        (UnmaskRuleContract, _CommitsOutsideBlock, "test_selection_contract_on_random_contexts"),
        (UnmaskRuleContract, _AllocatesOnDefaultDevice, "test_allocates_on_the_inputs_device"),
        (UnmaskRuleContract, _AllocatesOnDefaultDevice, "test_decode_allocates_on_the_model_device"),
        (EditRuleContract, _SelectsPadding, "test_selection_contract_on_random_contexts"),
        (EditRuleContract, _EditsMasks, "test_selection_contract_on_random_contexts"),
        (RemaskRuleContract, _GreedyRemask, "test_selection_contract_on_random_contexts"),
        (BlockScheduleContract, _CachedSeeLater, "test_kv_cache_matches_recompute"),
    ],
)
def test_suites_reject_broken_rules(base, rule_cls, test):
    suite = _suite(base, rule_cls)
    with pytest.raises(AssertionError):
        getattr(suite, test)()


def test_batch_invariance_catches_a_random_rule_sharing_one_stream():
    suite = type("Suite", (UnmaskRuleContract,), {"rule_factory": _OneStreamForAll, "uses_randomness": True})()
    with pytest.raises(AssertionError, match="alone"):
        suite.test_batch_invariance()


def test_suite_rejects_state_on_the_rule_object():
    M2T.register("_contract_stateful")(_Stateful)
    with pytest.raises(AssertionError, match="keeps attributes"):
        _suite(UnmaskRuleContract, _Stateful).test_keeps_no_state()


def test_suite_checks_unknown_keys_without_bounds():
    _suite(UnmaskRuleContract, _Unbounded).test_rejects_bad_config()  # no numeric field: still checked


def test_unregistered_subclass_keeps_its_own_identity():
    # a subclass of a registered rule is not that rule: its spec names the subclass itself
    inherited = type("InheritsThreshold", (M2T.get("threshold"),), {"__module__": __name__})
    globals()["InheritsThreshold"] = inherited
    assert inherited().name == f"{__name__}:InheritsThreshold"
    _suite(UnmaskRuleContract, inherited).test_config_round_trip()


# -- m2t with a verification forward (dlm_toolkit.hooks.verify) -----------------------------------


class TestIndel(IndelContract):  # t2t with insert/delete edits (dlm_toolkit.hooks.indel)
    rule_factory = T2T.get("indel")
    # the default, and one that repairs often on random contexts (so the checks see shifts)
    configs = [{}, {"delete_threshold": 0.2, "insert_threshold": 0.2, "keep_below": 0.9, "indel_steps": 4}]


class TestS2D2(VerifierContract):
    rule_factory = M2T.get("s2d2")
    configs = [{}, {"acceptance": "greedy", "threshold": 0.5}, {"min_span_length": 3, "ratio_exponent": 0.5}]
    uses_randomness = True

    def is_random(self, rule):
        return rule.config.acceptance == "rejection"
