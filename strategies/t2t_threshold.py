"""T2T ``threshold``: rewrite a written token when the model now prefers another one confidently.

Paper: LLaDA2.1 (arXiv 2602.08676), Token-to-Token editing. Reference: the LLaDA2.1 Hugging
Face ``generate()`` (``editing_threshold``): a written, non-prompt position is edited iff the
argmax differs from its token and the argmax confidence is > ``threshold`` (strict), from the
same forward as the M2T commits. Q mode uses 0.5, S mode 0.0.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import T2T, EditRule, StepContext, StrategyConfig


@T2T.register("threshold")
class ThresholdEdit(EditRule):
    class Config(StrategyConfig):
        threshold: float = Field(0.5, ge=0.0, le=1.0, description="edit iff confidence > threshold (strict)")

    GUARANTEES = frozenset({"inside"})  # an edit is editable (the first term)

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        return ctx.editable & (ctx.sampled != ctx.tokens) & (ctx.confidence > self.config.threshold)
