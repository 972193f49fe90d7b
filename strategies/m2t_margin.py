"""M2T ``margin``: a per-step quota of masks ranked by top-1 minus top-2 probability.

Paper: Dream 7B (Ye et al., arXiv 2508.15487), ``alg="topk_margin"`` (the margin ranking of
Kim et al., arXiv 2502.06768); reference: Dream's ``diffusion_generate``. Each step commits the
masks with the largest margin p(top1) - p(top2), as many as the step-count schedule asks for
(``strategies/schedules.py``: ``steps_per_block``, ``linear`` as LLaDA/Dream or ``cosine``),
at least one. With ``threshold`` set, every mask whose margin is > threshold is committed too
(parallel commits on top of the quota; Dream itself has none).
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, UnmaskRule
from dlm_toolkit.strategy.selection import rank_and_quota, top2_margin
from strategies.schedules import QuotaConfig, step_quota


@M2T.register("margin")
class MarginUnmask(UnmaskRule):
    class Config(QuotaConfig):
        threshold: float | None = Field(None, ge=0.0, le=1.0, description="also commit masks with margin > threshold")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        k = step_quota(cfg, ctx)
        return rank_and_quota(top2_margin(ctx.probs), ctx.fillable, k, cfg.threshold)
