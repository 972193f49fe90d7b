"""M2T ``credit``: threshold on confidence boosted by the credit a mask's candidate has built up.

Paper: dInfer (Ma et al., arXiv 2510.08666) credit decoding, after CreditDecoding (Wang et al.,
arXiv 2510.06133); reference: inclusionAI/dInfer ``CreditThresholdParallelDecoder``. Each mask's
candidate token v (``ctx.sampled``; the argmax at temperature 0) carries a credit
C <- beta * C + p_v ** gamma (decayed each forward, reset to 0 when the candidate changes).
The logit of v is raised by alpha * log(1 + C), so its boosted probability is
p_v b / (p_v b + 1 - p_v) with b = (1 + C) ** alpha; a mask is committed iff that is
> ``threshold``, at least the best one. Unlike the reference, which keeps a credit for every
(position, token), only the current candidate's credit is kept. Memory: per batch row and
absolute position, the candidate and its credit.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, Selection, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import at_least_one, recall, remember


@M2T.register("credit")
class CreditUnmask(UnmaskRule):
    class Config(StrategyConfig):
        threshold: float = Field(0.9, gt=0.0, le=1.0, description="commit iff boosted confidence > threshold")
        alpha: float = Field(0.7, ge=0.0, le=10.0, description="weight of log(1 + credit) added to the logit")
        gamma: float = Field(0.2, gt=0.0, le=10.0, description="credit gained per forward: p ** gamma")
        beta: float = Field(0.8, ge=0.0, le=1.0, description="decay of the credit per forward")

    def __call__(self, ctx: StepContext) -> Selection:
        cfg, old, p = self.config, ctx.memory.get(self.role), ctx.confidence
        token, seen = recall(old, ctx, "token", ctx.sampled.new_tensor(-1))
        credit, _ = recall(old, ctx, "credit", p.new_tensor(0.0))
        same = seen & (token == ctx.sampled)
        credit = torch.where(same, cfg.beta * credit, 0.0) + p.clamp(min=0) ** cfg.gamma
        boost = (1 + credit) ** cfg.alpha
        boosted = p * boost / (p * boost + 1 - p)
        commit = at_least_one(ctx.fillable & (boosted > cfg.threshold), boosted, ctx.fillable)
        keep = ctx.fillable & ~commit
        return Selection(commit, remember(old, ctx, keep, token=ctx.sampled, credit=credit))
