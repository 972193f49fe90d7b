"""M2T ``entropy``: a per-step quota of masks ranked by lowest predictive entropy.

Paper: Dream 7B (Ye et al., arXiv 2508.15487), ``alg="entropy"`` (score = negative entropy of
the predicted distribution); reference: Dream's ``diffusion_generate``. Each step commits the
lowest-entropy masks, as many as the step-count schedule asks for (``strategies/schedules.py``:
``steps_per_block``, ``linear`` or ``cosine``), at least one. With ``threshold`` set, every mask
whose entropy is < threshold (nats) is committed too (parallel commits on top of the quota).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.selection import entropy, rank_and_quota
from strategies.schedules import quota


@M2T.register("entropy")
class EntropyUnmask(UnmaskRule):
    class Config(StrategyConfig):
        steps_per_block: int = Field(32, ge=1, le=4096, description="forwards to fill one block")
        schedule: Literal["linear", "cosine"] = "linear"
        threshold: float | None = Field(None, ge=0.0, le=100.0, description="also commit masks with entropy < threshold (nats)")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        k = quota(cfg.schedule, ctx.block_masked_start, ctx.fillable.sum(1), cfg.steps_per_block, ctx.block_step)
        above = None if cfg.threshold is None else -cfg.threshold
        return rank_and_quota(-entropy(ctx.probs), ctx.fillable, k, above)
