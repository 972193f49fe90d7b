"""M2T ``entropy_bound``: commit the largest low-error prefix whose entropy sum minus max <= gamma.

Paper: EB-sampler, "Accelerated Sampling from Masked Diffusion Models via Entropy Bounded
Unmasking" (Ben-Hamu et al., arXiv 2505.24857). Sort the active block's masks by an error proxy,
lowest error first (``proxy``: entropy ascending, as the paper's default, or confidence /
top1-top2 margin descending); commit the largest prefix U with
sum_{l in U} H(p_l) - max_{l in U} H(p_l) <= gamma (H: entropy in nats), at least one.
The left side never decreases along the prefix, so this is the longest passing prefix.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import entropy, top2_margin, topk_per_row


@M2T.register("entropy_bound")
class EntropyBoundUnmask(UnmaskRule):
    class Config(StrategyConfig):
        gamma: float = Field(0.1, ge=0.0, le=1000.0, description="bound on sum(H) - max(H) of the committed set (nats)")
        proxy: Literal["entropy", "confidence", "margin"] = "entropy"

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        h = entropy(ctx.probs)
        score = {"entropy": -h, "confidence": ctx.confidence, "margin": top2_margin(ctx.probs)}[self.config.proxy]
        order = score.masked_fill(~ctx.fillable, float("-inf")).argsort(dim=1, descending=True, stable=True)
        h_sorted = h.gather(1, order)
        live = ctx.fillable.gather(1, order)
        bound = h_sorted.masked_fill(~live, 0.0)
        ok = live & (bound.cumsum(1) - bound.cummax(1).values <= self.config.gamma)
        k = ok.long().cumprod(1).sum(1).clamp(min=1)
        return topk_per_row(score, ctx.fillable, k)
