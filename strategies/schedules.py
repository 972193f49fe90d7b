"""Step-count schedules for quota rules: how many masks a block should have committed by step s.

``linear`` is LLaDA's ``get_num_transfer_tokens`` (arXiv 2502.09992): M masks over S steps,
``M // S`` per step with the remainder spread over the first steps. ``cosine`` is MaskGIT's
(arXiv 2202.04200) cosine mask ratio: few commits early, many late.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Literal

import torch
from pydantic import Field

from dlm_toolkit.config import StrategyConfig

if TYPE_CHECKING:
    from dlm_toolkit.strategy import StepContext

Schedule = Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor]


def linear(masks: torch.Tensor, steps: int, step: torch.Tensor) -> torch.Tensor:
    """Masks committed after ``step + 1`` steps: ``(step+1) * (M // S) + min(step+1, M % S)``."""
    done = (step + 1).clamp(max=steps)
    return done * (masks // steps) + torch.minimum(done, masks % steps)


def cosine(masks: torch.Tensor, steps: int, step: torch.Tensor) -> torch.Tensor:
    """Masks committed after ``step + 1`` steps: ``ceil(M * (1 - cos(pi/2 * (step+1)/S)))``."""
    frac = ((step + 1).clamp(max=steps).double() / steps) * (math.pi / 2)
    return torch.ceil(masks.double() * (1 - torch.cos(frac)) - 1e-9).long().clamp(max=masks)


SCHEDULES: dict[str, Schedule] = {"linear": linear, "cosine": cosine}


def quota(name: str, masks_start: torch.Tensor, masked_now: torch.Tensor, steps: int, step: torch.Tensor) -> torch.Tensor:
    """(B,) commits for this step: catch up with the schedule, at least 1, at most what is masked."""
    committed = masks_start - masked_now
    target = SCHEDULES[name](masks_start, steps, step)
    return torch.minimum((target - committed).clamp(min=1), masked_now)


class QuotaConfig(StrategyConfig):
    """Config fields shared by quota rules: the block's step budget and its schedule."""

    steps_per_block: int = Field(32, ge=1, le=4096, description="forwards to fill one block")
    schedule: Literal["linear", "cosine"] = "linear"


def step_quota(config: QuotaConfig, ctx: StepContext) -> torch.Tensor:
    """(B,) commits this step for a quota rule configured by ``config``."""
    return quota(config.schedule, ctx.block_masked_start, ctx.fillable.sum(1), config.steps_per_block, ctx.block_step)
