"""Contract suite of insert/delete T2T rules (:class:`~dlm_toolkit.hooks.indel.Indel`): everything a T2T rule
is checked for, plus ``indel`` on random contexts (applied with the engine's own shift, whose
result is checked independently), and end-to-end decodes on a tiny LLaDA2 model that pin the
engine's side of the hook (the KV cache stays exact while blocks shift)."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import torch

from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.hooks.indel import Indel, indel_region, shift_block, written_window
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.strategy.base import StepContext, Strategy
from dlm_toolkit.testing.contracts_cases import _as_tensor, build_context, random_case
from dlm_toolkit.testing.contracts_rules import EditRuleContract
from dlm_toolkit.testing.models import tiny_llada2


class IndelContract(EditRuleContract):
    """Contract suite for T2T rules that also insert and delete positions (:class:`~dlm_toolkit.hooks.indel.Indel`).

    Checks, besides :class:`EditRuleContract`'s, on random contexts after the step's commits and
    edits (the rule's own ``__call__``): ``indel`` returns two ``(B, W)`` bool tensors; selects
    nothing outside the valid, non-prompt slots of the active block of live rows; deletes only
    written tokens; never pushes a written token out of the block. The shift of the engine
    (:func:`~dlm_toolkit.hooks.indel.shift_block`) is applied and its result checked: the window and the
    block keep their lengths, everything outside the block (the prompt included) is identical, and
    the block's tokens are the old ones minus the deleted ones, in order. ``indel`` is
    batch-invariant and deterministic under a seed. End to end (tiny LLaDA2 model, blocks of 4):
    KV cache on and off give the same tokens, NFE and insert/delete counts.
    """

    n_indel_cases: ClassVar[int] = 30

    def indel_step(self, rule: Any, case: dict[str, Any], seed: int, rows: list[int] | None = None
                   ) -> tuple[StepContext, Any]:
        """A context of ``case`` after the step's commits (threshold 0.5) and the rule's edits, and
        the rule's ``indel`` output for it."""
        ctx = build_context(case, rows, seed=seed, memory={})
        self.prepare(ctx)
        ctx.edit = _as_tensor(rule, rule(ctx))[0] & ctx.editable
        ctx.remask = torch.zeros_like(ctx.edit)
        return ctx, rule.indel(ctx)

    def check_indel(self, rule: Strategy, ctx: StepContext, out: Any, where: str) -> None:
        """The contract of one ``indel`` output (class docstring)."""
        ok = isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
        assert ok, f"{where}: indel() returned {type(out).__name__}, expected (insert, delete), two tensors"
        insert, delete = out
        for name, t in (("insert", insert), ("delete", delete)):
            assert t.dtype == torch.bool, f"{where}: {name} has dtype {t.dtype}, expected torch.bool"
            assert t.shape == ctx.tokens.shape, f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(ctx.tokens.shape)}"
        region = indel_region(ctx)
        for name, t in (("insert", insert), ("delete", delete)):
            outside = t & ~region
            assert not outside.any(), (
                f"{where}: {name} selects slots {outside.nonzero().tolist()} outside the generated part of the active block")
        after = written_window(ctx)
        masks = delete & (after == ctx.mask_token_id)
        assert not masks.any(), f"{where}: delete selects slots {masks.nonzero().tolist()} that hold a mask (no written token)"
        new, _, _, overflow = shift_block(after, ctx.written_step, ctx.written_conf, region, insert, delete,
                                          ctx.mask_token_id)
        assert not overflow.any(), (
            f"{where}: the inserts of rows {overflow.nonzero().flatten().tolist()} push written tokens out of the block")
        assert new.shape == after.shape, f"{where}: the shift changed the window's length"
        assert torch.equal(new[~region], after[~region]), f"{where}: the shift changed slots outside the block (or the prompt)"
        for b in range(ctx.batch_size):
            r = region[b]
            old_kept = [t for t, d in zip(after[b][r].tolist(), delete[b][r].tolist()) if not d and t != ctx.mask_token_id]
            now = [t for t in new[b][r].tolist() if t != ctx.mask_token_id]
            assert now == old_kept, (f"{where}: row {b}: the block's tokens after the shift {now} are not the old ones "
                                     f"minus the deleted {old_kept}")

    def test_indel_contract_on_random_contexts(self):
        for rule in self.rules():
            assert isinstance(rule, Indel), f"{rule!r} is not an Indel"
            for seed in range(self.n_indel_cases):
                ctx, out = self.indel_step(rule, random_case(seed), seed)
                self.check_indel(rule, ctx, out, f"{rule!r} (case seed {seed})")

    def test_indel_is_batch_invariant_and_deterministic(self):
        for rule in self.rules():
            for seed in range(0, self.n_indel_cases, 2):
                case = random_case(seed)
                _, (insert, delete) = self.indel_step(rule, case, seed)
                _, (insert2, delete2) = self.indel_step(rule, case, seed)
                assert torch.equal(insert, insert2) and torch.equal(delete, delete2), f"{rule!r}: same seed, other indel"
                for i in range(case["tokens"].shape[0]):
                    _, (ins_alone, del_alone) = self.indel_step(rule, case, seed, [i])
                    same = torch.equal(ins_alone[0], insert[i]) and torch.equal(del_alone[0], delete[i])
                    assert same, f"{rule!r} (case seed {seed}): batch row {i} inserts/deletes otherwise than alone"

    # -- end to end, the engine's side --------------------------------------------------------
    def indel_policy(self, rule: Strategy) -> DecodingPolicy:
        return DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "t2t.name": rule.name,
                                               **{f"t2t.params.{k}": v for k, v in rule.config.model_dump().items()}})

    def test_indel_decode_is_cache_exact(self):
        for n, rule in enumerate(self.rules()):
            model, policy = tiny_llada2(seed=n), self.indel_policy(rule)
            rng = random.Random(n)
            prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 9))] for _ in range(3)]
            on = decode(model, prompts, policy, 10, kv_cache=True, seed=n)
            off = decode(model, prompts, policy, 10, kv_cache=False, seed=n)
            assert on.tokens == off.tokens, f"{rule!r}: KV cache on and off give other tokens"
            counts = [[(r.nfe, r.inserts, r.deletes) for r in res.rows] for res in (on, off)]
            assert counts[0] == counts[1], f"{rule!r}: KV cache on and off give other NFE or insert/delete counts: {counts}"
