"""Where each position sits inside the generated part of its active block, for rules that order
commits by position (DUS, PC-Sampler, the learned policy): tensor ops only, no host reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dlm_toolkit.strategy import StepContext


def block_offsets(ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(offset, span, generated)``: ``generated`` (B, W) marks the active block's real non-prompt
    positions, ``offset`` (B, W) long is a position's distance from the first of them (0 there,
    meaningless elsewhere) and ``span`` (B,) long counts them."""
    generated = ctx.in_block & ~ctx.is_prompt & ctx.valid
    far = ctx.positions.new_full((), torch.iinfo(torch.long).max)
    start = torch.where(generated, ctx.positions, far).min(1).values
    offset = torch.where(generated, ctx.positions - start[:, None], 0)
    return offset, generated.sum(1), generated
