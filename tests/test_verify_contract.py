"""Meta-tests of :class:`~dlm_toolkit.testing.VerifierContract`: a broken verifier, or an engine whose
verification forward is not counted or not exact with the KV cache, fails the suite."""

from __future__ import annotations

import importlib

import pytest
import torch

from dlm_toolkit import M2T
from dlm_toolkit.testing import VerifierContract

verify_module = importlib.import_module("dlm_toolkit.hooks.verify")
S2D2 = M2T.get("s2d2")


class _KeepsTheWholeSpan(S2D2):  # writes every drafted token of the span, whatever the verifier said
    def accept(self, ctx, draft, verify_logits):
        commit, _ = super().accept(ctx, draft, verify_logits)
        span = commit | (ctx.fillable & (ctx.fillable.long().cumsum(1) > 0))
        return span & ctx.fillable, draft


class _WritesTheVerifierChoiceEvenWhenItAgrees(S2D2):  # resamples a position the verifier accepted
    def accept(self, ctx, draft, verify_logits):
        commit, tokens = super().accept(ctx, draft, verify_logits)
        other = (draft + 1) % ctx.logits.shape[-1]
        other = torch.where(other == ctx.mask_token_id, (other + 1) % ctx.logits.shape[-1], other)
        return commit, torch.where(commit, other, tokens)


class _WritesOutsideTheBlock(S2D2):
    def accept(self, ctx, draft, verify_logits):
        commit, tokens = super().accept(ctx, draft, verify_logits)
        return commit | (ctx.valid & ~ctx.fillable), tokens


NAMES = {_KeepsTheWholeSpan: "_meta_keeps_span", _WritesTheVerifierChoiceEvenWhenItAgrees: "_meta_resamples",
         _WritesOutsideTheBlock: "_meta_outside"}


def suite(rule_cls=S2D2, configs=({},)):
    """A suite for ``rule_cls``, registered now (not at import: lists of registered rules other test
    files build at collection must not see it)."""
    if rule_cls is not S2D2 and NAMES[rule_cls] not in M2T.names():
        M2T.register(NAMES[rule_cls])(rule_cls)
    return type("Suite", (VerifierContract,), {"rule_factory": rule_cls, "configs": list(configs),
                                                "n_verify_cases": 12})()


def test_the_suite_passes_s2d2():
    s = suite(configs=[{}, {"acceptance": "greedy"}])
    s.test_accept_contract_on_random_contexts()
    s.test_verify_forward_is_counted()
    s.test_verify_forward_is_cache_exact()


def test_a_verifier_keeping_a_rejected_write_is_caught():
    with pytest.raises(AssertionError, match="that the verify forward rejected"):
        suite(_KeepsTheWholeSpan).test_accept_contract_on_random_contexts()


def test_a_verifier_rewriting_what_it_agreed_with_is_caught():
    with pytest.raises(AssertionError, match="the verifier agreed, yet other tokens were written"):
        suite(_WritesTheVerifierChoiceEvenWhenItAgrees).test_accept_contract_on_random_contexts()


def test_a_verifier_writing_outside_the_fillable_positions_is_caught():
    with pytest.raises(AssertionError, match="that are not fillable"):
        suite(_WritesOutsideTheBlock).test_accept_contract_on_random_contexts()


def test_an_uncounted_verification_forward_is_caught(monkeypatch):
    forward = verify_module.verify_forward

    def uncounted(engine, ctx, rows, draft):
        out = forward(engine, ctx, rows, draft)
        engine.state.counts[:, 0] -= rows.long()  # the NFE of the verification forward forgotten
        return out

    monkeypatch.setattr(verify_module, "verify_forward", uncounted)
    with pytest.raises(AssertionError, match="has NFE .* steps, .* of them verified"):
        suite().test_verify_forward_is_counted()


def test_a_verification_forward_blind_to_the_cache_is_caught(monkeypatch):
    forward = verify_module.verify_forward

    def blind(engine, ctx, rows, draft):  # the cached prefix not attended (its length taken as 0)
        cache_len = engine.state.cache_len
        if cache_len is not None:
            engine.state.cache_len = torch.zeros_like(cache_len)
        try:
            return forward(engine, ctx, rows, draft)
        finally:
            engine.state.cache_len = cache_len

    monkeypatch.setattr(verify_module, "verify_forward", blind)
    with pytest.raises(AssertionError, match="KV cache on and off give other"):
        suite(configs=[{"acceptance": "greedy"}, {}]).test_verify_forward_is_cache_exact()
