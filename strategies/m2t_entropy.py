"""M2T ``entropy``: a per-step quota of masks ranked by lowest predictive entropy.

Paper: Dream 7B (Ye et al., arXiv 2508.15487), ``alg="entropy"`` (score = negative entropy of
the predicted distribution); reference: Dream's ``diffusion_generate``. Each step commits the
lowest-entropy masks, as many as the step-count schedule asks for (``strategies/schedules.py``:
``steps_per_block``, ``linear`` or ``cosine``), at least one. With ``threshold`` set, every mask
whose entropy is < threshold (nats) is committed too (parallel commits on top of the quota).
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, UnmaskRule
from dlm_toolkit.strategy.selection import entropy, rank_and_quota
from strategies.schedules import QuotaConfig, step_quota


@M2T.register("entropy")
class EntropyUnmask(UnmaskRule):
    class Config(QuotaConfig):
        threshold: float | None = Field(None, ge=0.0, le=100.0, description="also commit masks with entropy < threshold (nats)")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        k = step_quota(cfg, ctx)
        above = None if cfg.threshold is None else -cfg.threshold
        return rank_and_quota(-entropy(ctx.probs), ctx.fillable, k, above)
