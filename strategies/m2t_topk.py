"""M2T ``topk``: commit a fixed quota of masks per step, ranked by confidence or at random.

Paper: LLaDA (arXiv 2502.09992), Algorithm "semi-autoregressive remasking" with
``low_confidence`` or ``random`` remasking; reference: LLaDA's ``generate.py``
(``get_num_transfer_tokens``: each block's masks spread evenly over its steps). The quota
follows a step-count schedule (``linear`` as LLaDA, or ``cosine``).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.selection import topk_per_row
from strategies.schedules import quota


@M2T.register("topk")
class TopKUnmask(UnmaskRule):
    class Config(StrategyConfig):
        steps_per_block: int = Field(32, ge=1, le=4096, description="forwards to fill one block")
        ranking: Literal["low_confidence", "random"] = "low_confidence"
        schedule: Literal["linear", "cosine"] = "linear"

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        masked_now = ctx.fillable.sum(1)
        k = quota(cfg.schedule, ctx.block_masked_start, masked_now, cfg.steps_per_block, ctx.block_step)
        if cfg.ranking == "random":
            score = torch.rand(ctx.confidence.shape, generator=ctx.generator)
        else:
            score = ctx.confidence
        return topk_per_row(score, ctx.fillable, k)
