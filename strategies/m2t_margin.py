"""M2T ``margin``: a per-step quota of masks ranked by top-1 minus top-2 probability.

Paper: Dream 7B (Ye et al., arXiv 2508.15487), ``alg="topk_margin"`` (the margin ranking of
Kim et al., arXiv 2502.06768); reference: Dream's ``diffusion_generate``. Each step commits the
masks with the largest margin p(top1) - p(top2), as many as the step-count schedule asks for
(``strategies/schedules.py``: ``steps_per_block``, ``linear`` as LLaDA/Dream or ``cosine``),
at least one. With ``threshold`` set, every mask whose margin is > threshold is committed too
(parallel commits on top of the quota; Dream itself has none).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.selection import rank_and_quota, top2_margin
from strategies.schedules import quota


@M2T.register("margin")
class MarginUnmask(UnmaskRule):
    class Config(StrategyConfig):
        steps_per_block: int = Field(32, ge=1, le=4096, description="forwards to fill one block")
        schedule: Literal["linear", "cosine"] = "linear"
        threshold: float | None = Field(None, ge=0.0, le=1.0, description="also commit masks with margin > threshold")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        k = quota(cfg.schedule, ctx.block_masked_start, ctx.fillable.sum(1), cfg.steps_per_block, ctx.block_step)
        return rank_and_quota(top2_margin(ctx.probs), ctx.fillable, k, cfg.threshold)
