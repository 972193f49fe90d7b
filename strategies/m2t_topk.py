"""M2T ``topk``: commit a fixed quota of masks per step, ranked by confidence or at random.

Paper: LLaDA (arXiv 2502.09992), Algorithm "semi-autoregressive remasking" with
``low_confidence`` or ``random`` remasking; reference: LLaDA's ``generate.py``
(``get_num_transfer_tokens``: each block's masks spread evenly over its steps). The quota
follows a step-count schedule (``linear`` as LLaDA, or ``cosine``).
"""

from __future__ import annotations

from typing import Literal

import torch

from dlm_toolkit import M2T, StepContext, UnmaskRule
from dlm_toolkit.strategy.selection import topk_per_row
from strategies.schedules import QuotaConfig, step_quota


@M2T.register("topk")
class TopKUnmask(UnmaskRule):
    class Config(QuotaConfig):
        ranking: Literal["low_confidence", "random"] = "low_confidence"

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        k = step_quota(cfg, ctx)
        if cfg.ranking == "random":
            score = ctx.rand()
        else:
            score = ctx.confidence
        return topk_per_row(score, ctx.fillable, k)
