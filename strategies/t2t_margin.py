"""T2T ``margin``: rewrite a written token when the model prefers another by a probability margin.

A margin-gated variant of LLaDA2.1 Token-to-Token editing (arXiv 2602.08676; the gate compares
the candidate with the token it would replace instead of with a fixed level): a written,
non-prompt position inside the edit window is edited iff the new candidate (``ctx.sampled``)
differs from its token and p(candidate) - p(current token) > ``delta`` (strict), both from the
same forward (``ctx.confidence`` and ``ctx.token_confidence``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import T2T, EditRule, StepContext, StrategyConfig


@T2T.register("margin")
class MarginEdit(EditRule):
    class Config(StrategyConfig):
        delta: float = Field(0.2, ge=0.0, le=1.0, description="edit iff p(new) - p(current) > delta (strict)")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        gain = ctx.confidence - ctx.token_confidence
        return ctx.editable & (ctx.sampled != ctx.tokens) & (gain > self.config.delta)
