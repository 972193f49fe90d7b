"""The key of a captured rule is derived from what the captured function closes over
(dlm_toolkit.step.capture.closure_key), not listed by hand: a value added to the closure changes the key
with no change to the key code, a rule's non-config attributes and the hook outputs set are part of
it, and a value with no canonical form runs the rule eagerly after one warning (never a stale replay).
Compiled with the ``aot_eager`` backend on hand-built contexts (seconds, not a model decode)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils import _pytree as pytree

from dlm_toolkit import DecodingPolicy
from dlm_toolkit.step.capture import Channel, Uncapturable, closure_key
from dlm_toolkit.hooks import Declaration, StepHook
from dlm_toolkit.decoding.rule_capture import RuleRunners, captured
from dlm_toolkit.strategy import Output
from dlm_toolkit.testing import make_context
from strategies.m2t_threshold import ThresholdUnmask

M = 11


def closing_over(*values):
    def fn(x):
        return (x, *values)

    return fn


def test_every_closed_over_value_is_in_the_key_canonically():
    assert closure_key(closing_over(1, "a")) == closure_key(closing_over(1, "a"))
    # near misses, each one value apart: the key code names none of them
    for a, b in ((1, 2), (1, 1.0), (1, True), (0.5, 0.25), ("a", "b"), ((1, 2), (2, 1)), ({"k": 1}, {"k": 2}),
                 (torch.float32, torch.float64), (None, 0)):
        assert closure_key(closing_over(a)) != closure_key(closing_over(b)), (a, b)
        assert closure_key(closing_over(a)) == closure_key(closing_over(a))
    assert closure_key(closing_over(float("nan"))) == closure_key(closing_over(float("nan")))  # else never reused
    assert closure_key(closing_over({"a": 1, "b": 2})) == closure_key(closing_over({"b": 2, "a": 1}))


def test_adding_a_closed_over_value_changes_the_key():
    extra = 3

    def plain(x):
        return x

    def reads_more(x):
        return x + extra

    assert closure_key(plain) != closure_key(reads_more)
    assert closure_key(closing_over(1)) != closure_key(closing_over(1, 2))


def test_nested_functions_channels_and_strategies():
    inner_a, inner_b = closing_over(1), closing_over(2)
    assert closure_key(closing_over(inner_a)) != closure_key(closing_over(inner_b))
    assert closure_key(closing_over(Channel(x=1))) == closure_key(closing_over(Channel(x=2)))  # results, not inputs
    low, high = ThresholdUnmask(threshold=0.2), ThresholdUnmask(threshold=0.9)
    assert closure_key(closing_over(low)) == closure_key(closing_over(ThresholdUnmask(threshold=0.2)))
    assert closure_key(closing_over(low)) != closure_key(closing_over(high))  # the config is in the key


def test_a_value_with_no_canonical_form_is_named():
    with pytest.raises(Uncapturable, match=r"^fn\.values\[0\] is a builtins.object, which has no canonical form"):
        closure_key(closing_over(object()))
    with pytest.raises(Uncapturable, match=r"fn\.values\[0\] is a torch.Tensor"):
        closure_key(closing_over(torch.zeros(2)))


class Shifted(ThresholdUnmask):
    """The threshold rule with a bias that is not config (held on the object, as a plug-in might)."""

    def __init__(self, bias: float, **params):
        super().__init__(**params)
        self.bias = bias

    def __call__(self, ctx):
        commit = ctx.fillable & (ctx.confidence + self.bias > self.config.threshold)
        top = torch.where(ctx.fillable, ctx.confidence, -1.0).argmax(1, keepdim=True)
        first = torch.zeros_like(commit).scatter_(1, top, True) & ctx.fillable
        return commit | first


class Opaque(Shifted):
    def __init__(self, **params):
        super().__init__(0.0, **params)
        self.table = object()  # nothing a capture could tell apart


class Scale(StepHook):
    def declare(self, policy):
        return Declaration(outputs={"scale": Output(("B", "W"), torch.float32)})


class ReadsScale(ThresholdUnmask):
    """Reads ``ctx.hooks.scale`` when a hook set it this step, the plain confidence when not."""

    def __call__(self, ctx):
        scale = ctx.hooks.scale
        confidence = ctx.confidence * scale if scale is not None else ctx.confidence
        top = torch.where(ctx.fillable, confidence, -1.0).argmax(1, keepdim=True)
        return (ctx.fillable & (confidence > self.config.threshold)) | (
            torch.zeros_like(ctx.fillable).scatter_(1, top, True) & ctx.fillable)


def contexts(**kwargs):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (2, 8), generator=gen)
    tokens[:, 2:7] = M
    logits = torch.randn(2, 8, 12, generator=gen) * 2
    return lambda: make_context(tokens, logits, mask_token_id=M, prompt_len=1, **kwargs)


POLICY = DecodingPolicy("llada2.1-q")


def run_captured(runners, rule, ctx):
    return runners.run(rule, ctx, {})


def test_rules_differing_only_in_a_non_config_attribute_get_their_own_runner():
    make = contexts()
    store: dict = {}
    runners = RuleRunners(POLICY, "compile", "aot_eager", store)
    a, b = Shifted(0.0, threshold=0.5), Shifted(0.4, threshold=0.5)
    spec = pytree.tree_flatten({})[1]
    keys = [closure_key(captured(r, spec, (), (), {}, make())[0]) for r in (a, b)]
    assert keys[0] != keys[1]
    got = [run_captured(runners, r, make()) for r in (a, b)]
    want = [r(make()) for r in (a, b)]
    assert not torch.equal(want[0], want[1])  # the bias matters on this context (else this checks nothing)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len([k for k in store if k[2] == "m2t"]) == 2
    run_captured(runners, Shifted(0.0, threshold=0.5), make())  # near miss: an equal rule reuses the first runner
    assert len(store) == 2


def test_hook_outputs_that_are_set_are_part_of_the_key():
    store: dict = {}
    runners = RuleRunners(POLICY, "compile", "aot_eager", store)
    rule = ReadsScale(threshold=0.5)
    scale = torch.full((2, 8), 3.0)
    unset, scaled = contexts(hooks=[Scale()]), contexts(hooks=[Scale()], outputs={"scale": scale})
    got = [run_captured(runners, rule, make()) for make in (unset, scaled)]
    want = [rule(make()) for make in (unset, scaled)]
    assert not torch.equal(want[0], want[1])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(store) == 2
    assert torch.equal(run_captured(runners, rule, unset()), want[0])  # replays the first runner, not the last
    assert len(store) == 2


def test_an_uncanonicalisable_rule_runs_eagerly_after_one_warning():
    make = contexts()
    store: dict = {}
    runners = RuleRunners(POLICY, "compile", "aot_eager", store)
    rule = Opaque(threshold=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [run_captured(runners, rule, make()) for _ in range(2)]
    messages = [str(w.message) for w in caught if "cannot be captured" in str(w.message)]
    assert len(messages) == 1, messages
    assert "m2t rule " in messages[0] and ".__dict__['table'] is a builtins.object" in messages[0]
    assert all(torch.equal(g, rule(make())) for g in got)
    assert store == {}  # nothing captured, nothing to replay stale
