"""M2T ``ancestral``: each mask is committed independently with probability 1 / (steps left).

Paper: MDLM (Sahoo et al., arXiv 2406.07524) ancestral sampling of the reverse process, Dream's
``alg="origin"`` (arXiv 2508.15487). With the linear schedule alpha_t = 1 - t over
``steps_per_block`` forwards S, a mask survives from t to s = t - 1/S with probability s / t,
so at block step k it is committed with probability (alpha_s - alpha_t) / (1 - alpha_t) = 1 / (S - k)
(all of them from step S - 1 on). Draws use each row's own stream (``ctx.rand``). When the draw commits nothing in
a row with masks, its most confident mask is committed, so every step makes progress.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import at_least_one


@M2T.register("ancestral")
class AncestralUnmask(UnmaskRule):
    class Config(StrategyConfig):
        steps_per_block: int = Field(32, ge=1, le=4096, description="forwards to fill one block")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        left = (self.config.steps_per_block - ctx.block_step).clamp(min=1)
        u = ctx.rand()
        commit = ctx.fillable & (u * left[:, None] < 1)
        return at_least_one(commit, ctx.confidence, ctx.fillable)
