"""Step checks left out where the policy's rules provably keep them (issue 43, engine overhead).

A built-in rule declares what its selections always satisfy (``GUARANTEES`` next to its ``__call__``:
``inside`` its role's region, ``progress``, ``nothing``); :class:`StepChecks` then leaves out the checks
those declarations prove, and the write skips applying remasks when the remask rule selects nothing.
Pinned here: every declaration against random contexts (the plain definitions, row by row), which
checks a policy keeps (near misses: an undeclared rule, a subclass overriding ``__call__``, a policy
with step hooks), a plug-in rule breaking its region still caught, and whole decodes with the checks
left out against the same decodes computing every check.
"""

from __future__ import annotations

import math

import pytest
import torch

from dlm_toolkit import M2T, DecodingPolicy, StrategyError, decode
from dlm_toolkit.decoding import policy as policy_module
from dlm_toolkit.decoding.policy import StepChecks, guaranteed
from dlm_toolkit.step.canvas import write_step
from dlm_toolkit.strategy.registry import REGISTRIES
from dlm_toolkit.strategy.selection import remaskable
from dlm_toolkit.testing import make_context, tiny_llada2
from strategies.m2t_threshold import ThresholdUnmask

import test_step_overhead
import test_step_pins

MASK, V = 31, 32

# every built-in rule that declares guarantees, and what it declares (a declaration added without a
# row here fails the first test: each one must be checked below)
DECLARED = {
    ("m2t", "threshold"): {"inside", "progress"},
    ("m2t", "s2d2"): {"inside", "progress"},  # ThresholdUnmask's __call__ (its verification is a step hook)
    ("m2t", "wino"): {"inside", "progress"},  # the same (WINO's wide-in)
    ("t2t", "threshold"): {"inside"},
    ("t2t", "none"): {"nothing"},
    ("remask", "none"): {"nothing"},
}


def random_context(seed: int):
    """Four rows, window 12: random tokens (a third masked), left padding, a prompt prefix, an active
    block interval, random logits (one row NaN somewhere: its confidences are NaN there), the
    selections of earlier roles filled in."""
    g = torch.Generator().manual_seed(seed)
    b, w = 4, 12
    tokens = torch.where(torch.rand(b, w, generator=g) < 0.35, MASK, torch.randint(0, MASK, (b, w), generator=g))
    start = torch.randint(0, 5, (b,), generator=g)
    pos = torch.arange(w)
    valid = pos >= start[:, None]
    lo = torch.randint(0, 8, (b,), generator=g)
    in_block = (pos >= lo[:, None]) & (pos < (lo + torch.randint(1, 6, (b,), generator=g))[:, None])
    logits = torch.randn(b, w, V, generator=g) * 4
    logits[seed % b, int(torch.randint(0, w, (1,), generator=g))] = math.nan
    ctx = make_context(tokens, logits, mask_token_id=MASK, valid=valid, prompt_len=torch.randint(0, 4, (b,), generator=g),
                       in_block=in_block)
    ctx.commit = torch.rand(b, w, generator=g) < 0.3
    ctx.edit = torch.rand(b, w, generator=g) < 0.2
    return ctx


def rule(role: str, name: str, **params):
    return REGISTRIES[role].get(name)(params)


def test_the_declarations_are_the_ones_checked_here():
    found = {(role, name): set(guaranteed(REGISTRIES[role].get(name)({})))
             for role in ("m2t", "t2t", "remask") for name in REGISTRIES[role].names()
             if not name.startswith("_") and guaranteed(REGISTRIES[role].get(name)({}))}
    assert found == DECLARED


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("role, name, params", [
    ("m2t", "threshold", {"threshold": 0.9}), ("m2t", "threshold", {"threshold": 1.0}),
    ("m2t", "threshold", {"threshold": 1e-6}), ("m2t", "s2d2", {}), ("m2t", "wino", {}),
    ("t2t", "threshold", {"threshold": 0.0}),
    ("t2t", "threshold", {"threshold": 0.5}), ("t2t", "none", {}), ("remask", "none", {}),
])
def test_each_declared_guarantee_holds_on_random_contexts(seed, role, name, params):
    ctx = random_context(seed)
    if role == "m2t":
        ctx.commit = ctx.edit = None
    out = rule(role, name, **params)(ctx)
    region = {"m2t": ctx.fillable, "t2t": ctx.editable, "remask": remaskable(ctx)}[role]
    for r in range(ctx.batch_size):
        sel, allowed = out[r].tolist(), region[r].tolist()
        if "inside" in DECLARED[role, name]:
            assert not any(s and not a for s, a in zip(sel, allowed))
        if "progress" in DECLARED[role, name] and any(ctx.fillable[r].tolist()):
            assert any(sel)
        if "nothing" in DECLARED[role, name]:
            assert not any(sel)


def test_a_subclass_overriding_call_declares_again_or_has_nothing():
    class Own(ThresholdUnmask):
        def __call__(self, ctx):
            return ctx.valid  # outside the fillable region

    class Same(ThresholdUnmask):
        pass

    assert guaranteed(Own({})) == frozenset() and guaranteed(Same({})) == {"inside", "progress"}


def policy(**more) -> DecodingPolicy:
    return DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, **more})


@pytest.mark.parametrize("more, left", [
    ({}, ["limit", "finite"]),  # llada2.1-q: threshold + threshold + none
    ({"remask.name": "low_confidence"}, ["remask", "net", "limit", "finite"]),
    ({"m2t.name": "entropy"}, ["m2t", "progress", "limit", "finite"]),
    ({"t2t.name": "margin"}, ["t2t", "limit", "finite"]),
    ({"m2t.name": "s2d2"}, list(StepChecks.NAMES)),  # a verifying hook: every check
])
def test_the_checks_a_policy_keeps(more, left):
    assert [f.name for f in StepChecks(policy(**more), 10).flags] == left


def test_a_plug_in_rule_breaking_its_region_is_still_caught():
    class Outside(ThresholdUnmask):
        def __call__(self, ctx):  # every valid slot, prompt included: outside fillable
            return ctx.valid

    if "_guarantees_outside" not in M2T.names():
        M2T.register("_guarantees_outside")(Outside)
    model = tiny_llada2(seed=5)
    with pytest.raises(StrategyError, match=r"m2t rule '_guarantees_outside' selected position \d+ of batch row 0, "
                                            r"which is not fillable"):
        decode(model, [[1, 2, 3, 4, 5]], policy(**{"m2t.name": "_guarantees_outside"}), 8)
    decode(model, [[1, 2, 3, 4, 5]], policy(), 8)  # the near miss: the declared rule decodes


@pytest.mark.parametrize("blocks, align, kv, block", [("semi_ar", "absolute", True, 4),
                                                      ("semi_ar", "prompt", False, 4),
                                                      ("_two_block_window", "prompt", True, 4)])
def test_decodes_with_the_proven_checks_left_out_equal_the_decodes_computing_every_check(blocks, align, kv, block,
                                                                                          monkeypatch):
    pol = test_step_pins.policy(blocks, align, block)
    assert len(StepChecks(pol, 10).flags) == 2
    fast = decode(test_step_pins.model(), test_step_pins.PROMPTS, pol, test_step_pins.GEN, kv_cache=kv)
    monkeypatch.setattr(policy_module, "provably_kept", lambda policy: frozenset())
    assert len(StepChecks(pol, 10).flags) == 7
    plain = decode(test_step_pins.model(), test_step_pins.PROMPTS, pol, test_step_pins.GEN, kv_cache=kv)
    assert test_step_pins.outcome(fast) == test_step_pins.outcome(plain)
    assert [r.remasks for r in fast.rows] == [0] * len(fast.rows) and any(r.edits for r in fast.rows)


@pytest.mark.parametrize("seed", range(4))
def test_the_write_without_remasks_is_the_write_of_an_empty_remask(seed):
    results = []
    for no_remask in (True, False):
        state, ctx, _ = test_step_overhead.a_step(seed)
        ctx.commit &= ctx.valid
        ctx.edit &= ctx.valid & ~ctx.commit
        ctx.remask = torch.zeros_like(ctx.commit)
        write_step(state, ctx, no_remask=no_remask)
        results.append((state.canvas, state.written_step, state.written_conf, state.counts, state.block_masked,
                        state.block_step))
    for a, b in zip(*results):  # the same bits (some confidences are NaN in this fixture)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
