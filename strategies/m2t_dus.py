"""M2T ``dus``: the Dilated Unmasking Scheduler, a block in log_base(B) forwards, coarse to fine.

A fixed order of positions, not a confidence ranking.

Paper: "Plan for Speed: Dilated Scheduling for Masked Diffusion Language Models" (Luxembourg,
Permuter, Nachmani; arXiv 2506.19037), the DUS planner: positions of a block are split into
non-adjacent, dilated groups, revealed one group per forward, so tokens committed together are
far apart (weakly dependent: the bound on the joint entropy gain stays small) and the number of
forwards per block is O(log B) instead of O(B), whatever the confidences.

Groups (our construction of the dilation; the paper fixes the idea, not this exact order): with
``o`` a position's offset from the first generated position of the block, ``n`` the block's
generated positions and ``K = ceil(log_base n)`` forwards, position ``o`` belongs to group
``g(o) = max(0, K - 1 - v(o))``, where ``v(o)`` is the number of times ``base`` divides ``o``
(``g(0) = 0``). With base 2 and n = 8: forward 0 reveals {0, 4}, forward 1 {2, 6}, forward 2 the
odd offsets: each later group bisects the gaps of the earlier ones. At block step ``s`` every
masked position with ``g <= s`` is committed (so a position re-masked by a remask rule is
refilled at the next step); if none is left, the lowest group's most confident mask is, so
every step makes progress. The rule ignores confidences otherwise: the paper's planner is
model-free.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import at_least_one
from strategies.block_geometry import block_offsets

MAX_POWERS = 13  # base ** 12 >= 4096, the longest block a schedule allows


def dilated_group(offset: torch.Tensor, span: torch.Tensor, base: int) -> torch.Tensor:
    """(B, W) long group of each offset (see the module docstring); ``span`` (B,) generated positions."""
    forwards = torch.zeros_like(span)  # K = ceil(log_base span): how many powers of base lie below span
    times_divided = torch.zeros_like(offset)  # v(offset), capped at MAX_POWERS - 1
    for j in range(MAX_POWERS):
        forwards = forwards + (base**j < span).long()
        if j:
            times_divided = times_divided + ((offset % base**j) == 0).long()
    # offset 0 is divided MAX_POWERS - 1 times, which puts it in group 0 with the block's middle
    return (forwards[:, None] - 1 - times_divided).clamp(min=0)


@M2T.register("dus")
class DilatedUnmask(UnmaskRule):
    class Config(StrategyConfig):
        base: int = Field(2, ge=2, le=16, description="dilation base: a block takes ceil(log_base n) forwards")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        offset, span, _ = block_offsets(ctx)
        group = dilated_group(offset, span, self.config.base)
        due = ctx.fillable & (group <= ctx.block_step[:, None])
        return at_least_one(due, ctx.confidence - 2.0 * group, ctx.fillable)
