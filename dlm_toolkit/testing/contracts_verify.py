"""Contract suite of verifying M2T rules (:class:`~dlm_toolkit.hooks.verify.Verifier`): everything an M2T
rule is checked for, plus the acceptance step on random contexts and random verify logits, and
end-to-end decodes on a tiny LLaDA2 model that pin the engine's side of the hook (the verification
forward is counted, and the KV cache stays exact)."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import torch

from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.strategy.base import StepContext, Strategy
from dlm_toolkit.testing.contracts_cases import _as_tensor, build_context, random_case
from dlm_toolkit.testing.contracts_rules import UnmaskRuleContract
from dlm_toolkit.testing.models import tiny_llada2
from dlm_toolkit.hooks.verify import Verifier


def verify_case(ctx: StepContext, draft: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    """Verify logits ``(B, W, V)`` of one kind: ``random``; ``agree`` (all mass on the drafted token);
    ``reject`` (probability 0 for the drafted token, random elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ctx.logits.shape, generator=gen) * 3
    hit = torch.nn.functional.one_hot(draft, ctx.logits.shape[-1]).bool()
    if kind == "agree":
        return torch.where(hit, 60.0, -60.0)
    if kind == "reject":
        return logits.masked_fill(hit, -torch.inf)
    return logits


class VerifierContract(UnmaskRuleContract):
    """Contract suite for M2T rules that ask for a verification forward.

    Checks, besides :class:`UnmaskRuleContract`'s: ``wants_verify`` is a ``(B,)`` bool; ``draft`` a
    ``(B, W)`` long window that keeps every non-fillable, non-edited position; ``accept`` writes only
    fillable positions, at least one in every verifying row with a mask, never the mask token, and
    never a drafted token the verify forward gives probability 0 (a write it rejected); a verify
    forward that agrees with the whole draft writes drafted tokens only; acceptance is
    batch-invariant and deterministic under a seed. End to end (tiny LLaDA2 model, blocks of 4):
    KV cache on and off give the same tokens and NFE, every verification forward is one NFE
    (``nfe`` = steps + verified steps; without the cache, batch 1: = the model's forward calls).
    """

    n_verify_cases: ClassVar[int] = 30

    def prepare(self, ctx: StepContext) -> None:
        if ctx.edit is None:  # the policy runs T2T before the verification: no edit here
            ctx.edit = torch.zeros_like(ctx.fillable)

    def _accept(self, rule: Any, case: dict[str, Any], seed: int, kind: str, rows: list[int] | None = None
                ) -> tuple[StepContext, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx = build_context(case, rows, seed=seed, memory={})
        self.prepare(ctx)
        ctx.commit = _as_tensor(rule, rule(ctx))[0]
        wants = rule.wants_verify(ctx)
        draft = rule.draft(ctx)
        full = build_context(case, seed=seed, memory={})
        self.prepare(full)
        logits = verify_case(full, rule.draft(full), kind, seed)
        if rows is not None:
            logits = logits[torch.as_tensor(rows)]
        commit, tokens = rule.accept(ctx, draft, logits)
        return ctx, wants, draft, commit, tokens

    def test_accept_contract_on_random_contexts(self):
        for rule in self.rules():
            assert isinstance(rule, Verifier), f"{rule!r} is not a Verifier"
            for seed in range(self.n_verify_cases):
                for kind in ("random", "agree", "reject"):
                    ctx, wants, draft, commit, tokens = self._accept(rule, random_case(seed), seed, kind)
                    where = f"{rule!r} (case seed {seed}, {kind} verifier)"
                    assert wants.dtype == torch.bool and wants.shape == (ctx.batch_size,), f"{where}: wants_verify shape"
                    assert draft.dtype == torch.long and draft.shape == ctx.tokens.shape, f"{where}: draft shape"
                    kept = ~(ctx.fillable | ctx.edit)
                    assert torch.equal(draft[kept], ctx.tokens[kept]), f"{where}: the draft changed positions it may not"
                    assert commit.dtype == torch.bool and commit.shape == ctx.tokens.shape, f"{where}: commit shape"
                    assert tokens.dtype == torch.long and tokens.shape == ctx.tokens.shape, f"{where}: tokens shape"
                    verifying = wants[:, None]
                    outside = commit & verifying & ~ctx.fillable
                    assert not outside.any(), f"{where}: wrote positions {outside.nonzero().tolist()} that are not fillable"
                    stalled = wants & ctx.fillable.any(1) & ~commit.any(1)
                    assert not stalled.any(), f"{where}: verifying rows {stalled.nonzero().flatten().tolist()} wrote nothing"
                    written = commit & verifying
                    assert not (written & (tokens == ctx.mask_token_id)).any(), f"{where}: wrote the mask token"
                    if kind == "reject":
                        bad = written & (tokens == draft)
                        assert not bad.any(), (
                            f"{where}: kept drafted tokens at {bad.nonzero().tolist()} that the verify forward rejected "
                            "(probability 0)")
                    if kind == "agree":
                        bad = written & (tokens != draft)
                        assert not bad.any(), f"{where}: the verifier agreed, yet other tokens were written at {bad.nonzero().tolist()}"

    def test_accept_is_batch_invariant_and_deterministic(self):
        for rule in self.rules():
            for seed in range(0, self.n_verify_cases, 2):
                case = random_case(seed)
                _, _, _, commit, tokens = self._accept(rule, case, seed, "random")
                _, _, _, commit2, tokens2 = self._accept(rule, case, seed, "random")
                assert torch.equal(commit, commit2) and torch.equal(tokens, tokens2), f"{rule!r}: same seed, other acceptance"
                for i in range(case["tokens"].shape[0]):
                    _, _, _, alone, alone_tokens = self._accept(rule, case, seed, "random", [i])
                    same = torch.equal(alone[0], commit[i]) and torch.equal(alone_tokens[0][alone[0]], tokens[i][commit[i]])
                    assert same, f"{rule!r} (case seed {seed}): batch row {i} accepts otherwise than alone"

    # -- end to end, the engine's side --------------------------------------------------------
    def verify_policy(self, rule: Strategy) -> DecodingPolicy:
        return DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "m2t.name": rule.name,
                                               **{f"m2t.params.{k}": v for k, v in rule.config.model_dump().items()}})

    def _prompts(self, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(0, 60) for _ in range(rng.randint(1, 9))] for _ in range(3)]

    def test_verify_forward_is_cache_exact(self):
        for n, rule in enumerate(self.rules()):
            model, policy = tiny_llada2(seed=n), self.verify_policy(rule)
            prompts = self._prompts(n)
            on = decode(model, prompts, policy, 10, kv_cache=True, seed=n)
            off = decode(model, prompts, policy, 10, kv_cache=False, seed=n)
            assert on.tokens == off.tokens, f"{rule!r}: KV cache on and off give other tokens"
            assert [r.nfe for r in on.rows] == [r.nfe for r in off.rows], f"{rule!r}: KV cache on and off give other NFE"

    def test_verify_forward_is_counted(self):
        for n, rule in enumerate(self.rules()):
            model, policy = tiny_llada2(seed=n), self.verify_policy(rule)
            res = decode(model, self._prompts(n), policy, 10, seed=n, record=True)
            for r, row in enumerate(res.rows):
                steps = res.trajectory.for_row(r)
                verified = sum(s.verified for s in steps)
                assert row.nfe == len(steps) + verified, (
                    f"{rule!r}: row {r} has NFE {row.nfe} for {len(steps)} steps, {verified} of them verified")
            assert any(s.verified for s in res.trajectory.steps), f"{rule!r}: no step verified; the contract checks nothing"
            calls = []
            forward = model.forward_window

            def counting(*args, **kwargs):
                calls.append(1)
                return forward(*args, **kwargs)

            model.forward_window = counting  # type: ignore[method-assign]
            try:
                alone = decode(model, self._prompts(n)[:1], policy, 10, seed=n, kv_cache=False)
            finally:
                del model.forward_window
            assert alone.rows[0].nfe == len(calls), (
                f"{rule!r}: NFE {alone.rows[0].nfe} but the model ran {len(calls)} forwards (batch 1, no cache)")
