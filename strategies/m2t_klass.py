"""M2T ``klass``: commit masks that are confident and whose distribution has stopped moving.

Paper: KLASS, KL-Adaptive Stability Sampling (Kim et al., arXiv 2511.05664); reference:
shkim0116/KLASS ``stable_confident_decode``. A mask is committed iff its confidence > ``threshold``
and KL(p_now || p_prev) < ``kl_threshold`` for each of the last ``history`` consecutive
forwards that saw it (so at the earliest on its ``history + 1``-th forward). When no mask
qualifies, the most confident one is committed (the reference falls back to a top-k quota).
Memory (``Selection.memory``): per batch row and absolute position, the last distribution and
the count of consecutive small-KL steps; a mask not seen in the row's previous forward starts over.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, Selection, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import at_least_one, recall, remember


@M2T.register("klass")
class KlassUnmask(UnmaskRule):
    class Config(StrategyConfig):
        threshold: float = Field(0.9, gt=0.0, le=1.0, description="commit needs confidence > threshold")
        kl_threshold: float = Field(0.01, gt=0.0, le=100.0, description="commit needs KL(now || previous) < kl_threshold")
        history: int = Field(2, ge=1, le=64, description="consecutive forwards the KL must stay small")

    def __call__(self, ctx: StepContext) -> Selection:
        cfg, old = self.config, ctx.memory.get(self.role)
        probs = ctx.probs
        prev, seen = recall(old, ctx, "probs", probs.new_zeros(probs.shape[-1]))
        streak, _ = recall(old, ctx, "streak", ctx.step.new_zeros(()))
        kl = (probs * ((probs + 1e-12).log() - (prev + 1e-12).log())).sum(-1)
        streak = torch.where(seen & (kl < cfg.kl_threshold), streak + 1, 0)
        ready = ctx.fillable & (streak >= cfg.history) & (ctx.confidence > cfg.threshold)
        commit = at_least_one(ready, ctx.confidence, ctx.fillable)
        return Selection(commit, remember(old, ctx, ctx.fillable & ~commit, probs=probs, streak=streak))
