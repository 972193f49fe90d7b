"""M2T ``threshold``: commit every masked position whose confidence clears a threshold.

Paper: LLaDA2.1 (arXiv 2602.08676) joint-threshold decoding; Fast-dLLM (arXiv 2505.22618)
confidence-aware parallel decoding. Reference: the LLaDA2.1 Hugging Face ``generate()``
(``threshold``; ``num_to_transfer`` 1): when no masked position clears the threshold, the single
most confident one is committed, so every step makes progress.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import top1_of_masked


@M2T.register("threshold")
class ThresholdUnmask(UnmaskRule):
    class Config(StrategyConfig):
        threshold: float = Field(0.9, gt=0.0, le=1.0, description="commit iff confidence > threshold (strict)")

    # inside: a commit is fillable (the score is -inf elsewhere, top1 is & fillable); progress: top1 over the fillable slots
    # picks one wherever there is one and no confidence is -inf (probabilities are not)
    GUARANTEES = frozenset({"inside", "progress"})

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        fillable = ctx.fillable
        # the confidence outside fillable at -inf: "fillable & above the threshold" is one comparison
        # (-inf clears no threshold), and top1 reuses the same tensor
        score = torch.where(fillable, ctx.confidence, float("-inf"))
        commit = score > self.config.threshold
        # the top-1 is empty where nothing is fillable, so "rows with no commit" is the whole condition
        return torch.where(commit.any(1, keepdim=True), commit, top1_of_masked(score, fillable))
