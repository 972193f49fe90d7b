"""Remask ``low_confidence``: turn back into masks the written tokens the model no longer trusts.

Paper: WINO, "Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs"
(Hong et al., arXiv 2507.18578), the narrow-out step; reference: Feng-Hong/WINO-DLLM. A written,
non-prompt token of the active block (not edited this step) is re-masked iff the probability the
model now gives it, ``ctx.token_confidence``, is < ``threshold``; lowest first, at most
(commits this step - 1) per row so every step keeps net progress >= 1, and only while the block
still has masks. WINO scores a token with itself masked (a shadow block); here it is the same
forward with the token visible, which is cheaper and more lenient.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import REMASK, RemaskRule, StepContext, StrategyConfig
from dlm_toolkit.strategy.selection import remask_budget, remaskable, topk_per_row


@REMASK.register("low_confidence")
class LowConfidenceRemask(RemaskRule):
    class Config(StrategyConfig):
        threshold: float = Field(0.9, gt=0.0, le=1.0, description="re-mask iff p(current token) < threshold")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        conf = self.support(ctx)
        weak = remaskable(ctx) & (conf < self.config.threshold)
        return topk_per_row(-conf, weak, remask_budget(ctx))

    def support(self, ctx: StepContext) -> torch.Tensor:
        """(B, W) how much the model supports each written token now: ``ctx.token_confidence``."""
        return ctx.token_confidence
