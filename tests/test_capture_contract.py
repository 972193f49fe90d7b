"""The capture contract (issue 25 part 3): what compiles full-graph with static shapes reads nothing
back to the host, so it can run in a CUDA graph. Built-in rules pass it in the contract suites
(tests/test_contracts.py runs ``test_capture_safe`` for each); here the suite is shown to catch
rules that read the host, and the engine to run such a rule eagerly, with one warning naming it and
the tokens of the eager decode."""

from __future__ import annotations

import warnings

import pytest
import torch

from dlm_toolkit import DecodingPolicy, M2T, UnmaskRule, decode
from dlm_toolkit.strategy.selection import top1
from dlm_toolkit.testing import UnmaskRuleContract
from dlm_toolkit.testing.contracts_capture import capture_problems, engine
from dlm_toolkit.testing import tiny_llada2


class _ReadsItem(UnmaskRule):  # a Python branch on a device value: a host read every step
    def __call__(self, ctx):
        if ctx.confidence.max().item() > 0.99:
            return top1(ctx.confidence, ctx.fillable)
        return top1(-ctx.confidence, ctx.fillable)


class _Nonzero(UnmaskRule):  # data-dependent shape: the host must learn how many there are
    def __call__(self, ctx):
        rows, cols = ctx.fillable.nonzero(as_tuple=True)
        first = torch.zeros_like(ctx.fillable)
        first[rows, cols] = True
        return top1(ctx.confidence, first)


class _BoolIndex(UnmaskRule):  # boolean-mask indexing: a nonzero in disguise
    def __call__(self, ctx):
        score = ctx.confidence.clone()
        score[~ctx.fillable] = -1.0
        picked = score[ctx.fillable]  # the host needs the count
        return top1(score + 0 * picked.sum(), ctx.fillable)


@pytest.mark.parametrize("rule_cls", [_ReadsItem, _Nonzero, _BoolIndex])
def test_suite_catches_a_rule_that_reads_the_host(rule_cls):
    M2T.register(f"_capture_{rule_cls.__name__.lower()}")(rule_cls)
    suite = type("Suite", (UnmaskRuleContract,), {"rule_factory": rule_cls})()
    with pytest.raises(AssertionError, match="not capture-safe.*m2t rule '_capture_"):
        suite.test_capture_safe()


def test_a_rule_that_cannot_be_captured_runs_eagerly_with_one_warning(monkeypatch):
    monkeypatch.setattr(engine, "COMPILE_BACKEND", "aot_eager")
    M2T.register("_capture_item_engine")(_ReadsItem)
    model = tiny_llada2(seed=2)
    policy = DecodingPolicy.from_rules(_ReadsItem(), DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4}).blocks)
    prompts = [[1, 2, 3], [4, 5]]
    eager = decode(model, prompts, policy, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = decode(model, prompts, policy, 12, capture="compile")
        again = decode(model, prompts, policy, 12, capture="compile")  # the runner is kept: no new warning
    messages = [str(w.message) for w in caught if "cannot be captured" in str(w.message)]
    assert len(messages) == 1 and "m2t rule '_capture_item_engine'" in messages[0]
    assert captured.tokens == eager.tokens == again.tokens
    assert [r.nfe for r in captured.rows] == [r.nfe for r in eager.rows]


def test_capture_problems_are_empty_for_a_safe_policy():
    policy = DecodingPolicy("llada2.1-s", **{"blocks.params.block_length": 4, "remask.name": "remdm"})
    assert capture_problems(policy.remask, policy) == []


def test_captured_rules_draw_as_the_eager_ones():
    """Sampling, ancestral M2T and ReMDM draw once each per step: a captured rule must take the draw
    index the eager one would (and pass the next one on), or two rules would share numbers."""
    from dlm_toolkit.config import SamplingConfig
    from dlm_toolkit.decoding.rule_capture import RuleRunners
    from dlm_toolkit.testing import make_context

    policy = DecodingPolicy("llada2.1-s", **{"m2t.name": "ancestral", "m2t.params.steps_per_block": 2,
                                             "remask.name": "remdm", "remask.params.eta": 1.0})
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (4, 8), generator=gen)
    tokens[:, 2:6] = 11
    logits = torch.randn(4, 8, 12, generator=gen) * 3

    def ctx():
        return make_context(tokens, logits, mask_token_id=11, sampling=SamplingConfig(temperature=1.0), prompt_len=1,
                            block_masked_start=torch.full((4,), 6), block_step=1, seed=5)

    eager, captured = ctx(), ctx()
    policy.step(eager, {})
    RuleRunners(policy, "compile", "aot_eager", {}).step(captured, {})
    assert eager.draws == captured.draws == 3
    for name in ("commit", "edit", "remask"):
        assert torch.equal(getattr(eager, name), getattr(captured, name))
