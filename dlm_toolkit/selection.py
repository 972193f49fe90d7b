"""Small tensor helpers shared by selection rules."""

from __future__ import annotations

import torch


def top1(score: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the highest-``score`` allowed position of each row (none if none allowed)."""
    return topk_per_row(score, allowed, torch.ones(score.shape[0], dtype=torch.long))


def topk_per_row(score: torch.Tensor, allowed: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the ``k[b]`` highest-``score`` allowed positions of row b.

    Ties break towards the lower position (a stable sort), so results are deterministic.
    """
    masked_score = score.masked_fill(~allowed, float("-inf"))
    order = masked_score.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(score.shape[1]).expand_as(order))
    return allowed & (rank < k[:, None])
