"""M2T ``factor``: commit the n most confident masks while (n + 1)(1 - c_n) < f.

Paper: Fast-dLLM (arXiv 2505.22618), "factor-based" confidence-aware parallel decoding;
reference: NVlabs/Fast-dLLM ``get_transfer_index_dynamic``. Sort the masked confidences of the
active block descending, c_1 >= c_2 >= ...; commit the largest n with (n + 1)(1 - c_n) < f
(strict, as the paper writes it), and always at least the most confident one. The left side
grows with n, so this is the longest prefix that passes. The reference code accepts equality
(c_n >= 1 - f/(n + 1)) and, due to its loop bound, also commits the last mask when only that
one fails; we follow the paper.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import topk_per_row


@M2T.register("factor")
class FactorUnmask(UnmaskRule):
    class Config(StrategyConfig):
        factor: float = Field(1.0, gt=0.0, le=64.0, description="commit n while (n+1)(1-c_n) < factor")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        conf = ctx.confidence.masked_fill(~ctx.fillable, float("-inf"))
        sorted_conf = conf.sort(dim=1, descending=True, stable=True).values
        n = torch.arange(1, ctx.width + 1, device=ctx.device)
        ok = ((n + 1) * (1 - sorted_conf) < self.config.factor) & (sorted_conf > float("-inf"))
        ok[:, 0] = True  # at least one
        k = ok.long().cumprod(1).sum(1).clamp(max=ctx.fillable.sum(1))
        return topk_per_row(ctx.confidence, ctx.fillable, k)
