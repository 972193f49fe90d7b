"""Blocks ``multi_block_edit`` (MBE): T2T edits reach up to ``edit_blocks`` previous blocks.

Paper: LLaDA2.1 (arXiv 2602.08676) multi-block editing; no public code, so this is our design on
top of the reference loop (transcribed in ``conformance/reference.py``): each forward covers the
active block plus up to ``edit_blocks`` finished blocks before it, and T2T may edit any written,
non-prompt position of the window.

Attention (``attention_groups``): the whole window is one group, so every window position sees
every other one (earlier blocks see the new one); before the window attention is block-causal
(position i sees j iff j's block <= i's block). Blocks leave the window, and only then enter the
exact prefix KV cache (``cache_boundary`` = window start), once ``edit_blocks`` newer blocks
exist: the window is recomputed every forward, which is the extra compute (``forward_tokens``) MBE
costs. Edits in earlier blocks keep the active block's post-step loop going, within
``max_post_steps``. With ``edit_blocks: 0`` this is exactly ``semi_ar``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import BLOCKS, DecodeState, StepContext
from strategies.blocks_semi_ar import SemiAutoregressive


@BLOCKS.register("multi_block_edit")
class MultiBlockEdit(SemiAutoregressive):
    class Config(SemiAutoregressive.Config):
        edit_blocks: int = Field(1, ge=0, le=16, description="previous blocks inside the edit window")

    def window(self, state: DecodeState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = state.block_bounds(rows)
        origin = state.origin[rows]
        bl = self.block_length
        # the first block holding a generated position: earlier blocks are all prompt
        first = origin + torch.div(state.prompt_len[rows] - origin, bl, rounding_mode="floor") * bl
        return torch.maximum(lo - self.config.edit_blocks * bl, first), hi

    def window_width(self) -> int:
        return (self.config.edit_blocks + 1) * self.block_length

    def attention_groups(self, state: DecodeState, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        group = super().attention_groups(state, rows, positions)
        lo, _ = self.window(state, rows)
        return torch.where(positions >= lo[:, None], state.block[rows, None], group)

    def edit_region(self, state: DecodeState, ctx: StepContext) -> torch.Tensor:
        return ctx.valid
