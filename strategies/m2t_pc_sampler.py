"""M2T ``pc_sampler``: position-aware, content-calibrated confidence ranking.

Paper: "PC-Sampler: Position-Aware Calibration of Decoding Bias in Masked Diffusion Models"
(Huang et al., arXiv 2508.13021). Each mask i with candidate token x_i (``ctx.sampled``) is
scored

    score_i = w_i * C_i,   w_i = exp(-lambda * o_i),   C_i = -p(x_i) * log(max(p_bg(x_i), epsilon))

(position-aware weight times calibrated confidence): ``o_i`` is the offset of i from the first
generated position of the active block, so early positions go first (global trajectory control),
and ``C_i`` discounts tokens that are frequent everywhere (EOS, padding, punctuation: the
"trivial tokens" that plain confidence commits too early). The masks with the best scores are
committed, a quota per step as LLaDA's schedule (``steps_per_block``, ``schedule``).

Choices where the paper leaves the detail to the setting: the paper estimates p_bg, the
background token frequency, from a reference corpus; a decode has no corpus, so here p_bg is the
model's own mean predicted distribution over the row's real window positions in this forward (a
token predicted everywhere is trivial for this canvas). Offsets restart in every block (the paper
decodes without blocks; a block is this toolkit's unit of decoding). Defaults: lambda = 0.25 and
epsilon = 1e-3 (our choice inside the paper's tuned range); the quota default is
``QuotaConfig``'s.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, UnmaskRule
from dlm_toolkit.strategy.selection import topk_per_row
from strategies.block_geometry import block_offsets
from strategies.schedules import QuotaConfig, step_quota


def background(ctx: StepContext) -> torch.Tensor:
    """(B, V) each row's mean predicted distribution over its real window positions."""
    weights = ctx.valid.float()[..., None]
    return (ctx.probs * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def pc_score(ctx: StepContext, lam: float, epsilon: float) -> torch.Tensor:
    """(B, W) the PC-Sampler score ``exp(-lam * offset) * -p * log(max(p_bg, epsilon))``."""
    offset, _, _ = block_offsets(ctx)
    p_bg = background(ctx).gather(1, ctx.sampled).clamp(min=epsilon)
    return torch.exp(-lam * offset.float()) * (-ctx.confidence * torch.log(p_bg))


@M2T.register("pc_sampler")
class PCSamplerUnmask(UnmaskRule):
    class Config(QuotaConfig):
        lam: float = Field(0.25, ge=0.0, le=10.0, description="position decay lambda of w = exp(-lambda * offset)")
        epsilon: float = Field(1e-3, gt=0.0, le=1.0, description="floor of the background probability in the log")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        return topk_per_row(pc_score(ctx, cfg.lam, cfg.epsilon), ctx.fillable, step_quota(cfg, ctx))
