"""M2T ``hierarchy``: per masked segment, commit its best mask if > low_threshold; plus all > threshold.

Paper: dInfer (Ma et al., arXiv 2510.08666), hierarchical decoding; reference:
inclusionAI/dInfer ``HierarchyDecoder``. The active block's masked positions split into
segments, the maximal runs of consecutive masks; in each segment the most confident mask is
committed if its confidence > ``low_threshold`` (ties: all tied maxima, as the reference), every
mask with confidence > ``threshold`` is committed, and so is the block's single most confident
mask (at least one per step). Neighbouring masks of one run thus commit one at a time unless
both are very confident, which keeps parallel commits apart.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.strategy.selection import top1


@M2T.register("hierarchy")
class HierarchyUnmask(UnmaskRule):
    class Config(StrategyConfig):
        threshold: float = Field(0.9, gt=0.0, le=1.0, description="commit every mask with confidence > threshold")
        low_threshold: float = Field(0.4, ge=0.0, le=1.0, description="commit a segment's best mask if > low_threshold")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        fill, conf = ctx.fillable, ctx.confidence
        prev = torch.cat([torch.zeros_like(fill[:, :1]), fill[:, :-1]], dim=1)
        segment = (fill & ~prev).long().cumsum(1)  # 1, 2, ... on masks (0 before the first run)
        score = conf.masked_fill(~fill, float("-inf"))
        seg_max = torch.full_like(conf, float("-inf")).scatter_reduce(1, segment, score, "amax")
        best = fill & (score == seg_max.gather(1, segment)) & (conf > self.config.low_threshold)
        return best | (fill & (conf > self.config.threshold)) | top1(conf, fill)
