"""T2T ``indel``: the threshold edit plus Levenshtein-style shift repairs (insert/delete edits).

Source: issue 26 names "LLaDA2.2's insert/delete (Levenshtein) edits"; no public text of LLaDA2.2
is available to us, so this is our own rule in that spirit, built from the two edit operations of
the Levenshtein Transformer (Gu, Wang, Zhao; arXiv 1905.11006): *deletion* and *placeholder
insertion* (a mask that a later step fills), on top of LLaDA2.1's substitution edit
(``t2t: threshold``, arXiv 2602.08676). The engine side is :mod:`dlm_toolkit.hooks.indel`.

Why: parallel decoding writes neighbouring positions from one forward, so a draft can hold a
stutter (``a b b c``: one token twice) or a gap (``a c d``: one token missing). Substitution
repairs those only by rewriting every later token; a shift repairs them in one operation.

Per step (greedy arithmetic on the forward's probabilities, whatever the sampling temperature):

* ``__call__``: the plain threshold edit (``threshold``, as ``t2t: threshold``), except at the two
  slots of the shift repair the rule chose for the row (the repair, not a substitution, fixes them).
* ``indel``: at most one repair per row and step, on tokens the forward saw and the step left
  unchanged (written before the step, neither edited nor remasked now), both slots in the generated
  part of the active block, only in the block's first ``indel_steps`` forwards:

  - **delete** the token at ``j`` (a stutter: the sequence should shift left) when the model's
    argmax at ``j`` is the token now at ``j+1``, not the one at ``j``, with probability >
    ``delete_threshold``, and the token at ``j`` has probability < ``keep_below``;
  - **insert** a mask before ``j`` (a gap: the sequence should shift right) when the model's argmax
    at ``j+1`` is the token now at ``j``, not the one at ``j+1``, with probability >
    ``insert_threshold``, the token at ``j`` has probability < ``keep_below``, and the block's last
    slot holds a mask after the step's write (it absorbs the shift, so the rule never pushes a token
    out of the block).

  "Not the one at j" matters where a token repeats (``x x``, which the model may want): without it a
  ``keep_below`` above the thresholds would delete a doubled token the model agrees with, then the
  step refills the block's end and the next step deletes it again.

Our decisions where the issue leaves them open: one repair per row and step (after a shift every
later position has new neighbours; the next forward judges the next repair); deletes first, then
the most confident candidate (leftmost on ties) — a stutter is the commoner failure of parallel
decoding, and a delete never needs room; ``indel_steps`` bounds the forwards deletes add (each adds
a mask), and :meth:`max_indel_forwards` tells the engine that bound. With ``delete_threshold`` and
``insert_threshold`` at 1.0 (a probability is never > 1) the rule is exactly ``t2t: threshold``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import T2T, StepContext
from dlm_toolkit.hooks.indel import Indel, indel_region, region_end, written_window
from dlm_toolkit.strategy.selection import top1
from strategies.t2t_threshold import ThresholdEdit


@T2T.register("indel")
class IndelEdit(ThresholdEdit, Indel):
    """Substitution edits (threshold) plus one delete-a-stutter / insert-a-gap repair per row and step."""

    class Config(ThresholdEdit.Config):
        delete_threshold: float = Field(0.9, ge=0.0, le=1.0,
                                        description="delete j iff p(argmax at j = token at j+1) > delete_threshold")
        insert_threshold: float = Field(0.9, ge=0.0, le=1.0,
                                        description="insert before j iff p(argmax at j+1 = token at j) > insert_threshold")
        keep_below: float = Field(0.3, ge=0.0, le=1.0,
                                  description="only repair around a token j whose probability now is < keep_below")
        indel_steps: int = Field(16, ge=0, le=4096,
                                 description="repair only in a block's first indel_steps forwards (bounds the forwards deletes add)")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        commit = ctx.commit if ctx.commit is not None else torch.zeros_like(ctx.valid)
        after = torch.where(commit, ctx.sampled, ctx.tokens)  # remasks only add room: decided without them
        insert, delete = self.repairs(ctx, after, torch.zeros_like(ctx.valid))
        chosen = insert | delete
        involved = chosen | torch.cat([torch.zeros_like(chosen[:, :1]), chosen[:, :-1]], 1)  # j and j+1
        return super().__call__(ctx) & ~involved

    def indel(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
        return self.repairs(ctx, written_window(ctx), ctx.commit | ctx.edit | ctx.remask)

    def max_indel_forwards(self, block_length: int) -> int:
        return int(self.config.indel_steps)  # at most one delete per forward, in the first indel_steps

    def repairs(self, ctx: StepContext, after: torch.Tensor, changed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(insert, delete)``: the row's one chosen repair (module docstring), judged on the window
        ``after`` the write, with ``changed`` the slots the step wrote or remasked."""
        cfg = self.config
        region = indel_region(ctx)
        still = region & ~ctx.masked & ~changed & (ctx.block_step < cfg.indel_steps)[:, None]
        pair = still[:, :-1] & still[:, 1:]  # slots j and j+1 both judged, (B, W-1)
        best_p, best = ctx.probs.max(-1)
        doubt = ctx.token_confidence[:, :-1] < cfg.keep_below
        tokens = ctx.tokens
        # the model wants another token at j, the one now at j+1 (so a repeated token it agrees with stays)
        delete = (pair & doubt & (best[:, :-1] == tokens[:, 1:]) & (best[:, :-1] != tokens[:, :-1])
                  & (best_p[:, :-1] > cfg.delete_threshold))
        room = (region_end(region) & (after == ctx.mask_token_id)).any(1, keepdim=True)
        insert = (pair & doubt & room & (best[:, 1:] == tokens[:, :-1]) & (best[:, 1:] != tokens[:, 1:])
                  & (best_p[:, 1:] > cfg.insert_threshold))
        pad = torch.zeros_like(region[:, :1])
        delete, insert = torch.cat([delete, pad], 1), torch.cat([insert, pad], 1)
        score_d = torch.cat([best_p[:, :-1], best_p.new_zeros(best_p.shape[0], 1)], 1)
        score_i = torch.cat([best_p[:, 1:], best_p.new_zeros(best_p.shape[0], 1)], 1)
        delete = top1(score_d, delete)
        insert = top1(score_i, insert) & ~delete.any(1, keepdim=True)
        return insert, delete
