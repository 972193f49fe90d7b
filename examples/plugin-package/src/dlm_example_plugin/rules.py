"""M2T ``confidence_ratio``: commit masks whose top-1 probability is ``ratio`` times their top-2.

An example plug-in rule. A position whose best token is much more likely than the runner-up is
safe to commit even when its absolute confidence is modest (e.g. 0.4 vs 0.05 over a long tail).
Rule: commit every mask of the active block with p(top1) > ratio * p(top2) (strict); when none
qualifies, the mask with the largest ratio, so every step makes progress.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import at_least_one


@M2T.register("confidence_ratio")
class ConfidenceRatioUnmask(UnmaskRule):
    class Config(StrategyConfig):
        ratio: float = Field(4.0, ge=1.0, le=1e6, description="commit iff p(top1) > ratio * p(top2)")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        top = ctx.probs.topk(2, dim=-1).values
        score = top[..., 0] / top[..., 1].clamp(min=1e-12)
        commit = ctx.fillable & (top[..., 0] > self.config.ratio * top[..., 1])
        return at_least_one(commit, score, ctx.fillable)


from dlm_example_plugin import hooks  # noqa: E402,F401 -- the entry point's module: importing it registers freeze_first too
