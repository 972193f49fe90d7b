"""Remask ``remdm``: re-mask each written token of the active block with probability sigma_t.

Paper: ReMDM, "Remasking Discrete Diffusion Models with Inference-Time Scaling" (Wang et al.,
arXiv 2503.00307); reference: kuleshov-group/remdm. With alpha the written fraction of the
block's masks before this step (alpha_t) and after its commits (alpha_s), the largest allowed
rate is sigma_max = min(1, (1 - alpha_s) / alpha_t). ``schedule``: ``cap`` sigma = min(eta,
sigma_max); ``rescale`` sigma = eta * sigma_max; ``conf`` sigma_l = eta_conf_l * sigma_max with
eta_conf = softmax(-psi) over the candidates, psi_l the confidence the token was written with
(``ctx.written_conf``; ``eta`` unused). Candidates: written, non-prompt, not edited now, in the
active block; draws use each row's own stream (``ctx.rand``); at most (commits - 1) per row are kept (a uniformly
random subset), so every step keeps net progress >= 1.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dlm_toolkit import REMASK, RemaskRule, StepContext, StrategyConfig
from dlm_toolkit.strategy.selection import remask_budget, remaskable, topk_per_row


@REMASK.register("remdm")
class ReMDMRemask(RemaskRule):
    class Config(StrategyConfig):
        schedule: Literal["cap", "rescale", "conf"] = "cap"
        eta: float = Field(0.02, ge=0.0, le=1.0, description="eta_cap or eta_rescale")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cand = remaskable(ctx)
        masked = ctx.fillable.sum(1)
        written = (ctx.block_masked_start - masked).clamp(min=0)
        left = masked - (ctx.commit.sum(1) if ctx.commit is not None else 0)
        sigma_max = torch.where(written > 0, left / written.clamp(min=1), 0.0).clamp(0, 1)[:, None]
        if self.config.schedule == "cap":
            sigma = sigma_max.clamp(max=self.config.eta)
        elif self.config.schedule == "rescale":
            sigma = self.config.eta * sigma_max
        else:
            weight = torch.softmax((-ctx.written_conf).masked_fill(~cand, float("-inf")), dim=1)
            sigma = weight.nan_to_num(0.0) * sigma_max
        u = ctx.rand()
        return topk_per_row(-u, cand & (u < sigma), remask_budget(ctx))
