"""T2T ``none``: never edit written tokens (LLaDA, Fast-dLLM, LLaDA2.0, LLaDA2.1 without editing)."""

from __future__ import annotations

import torch

from dlm_toolkit import T2T, EditRule, StepContext


@T2T.register("none")
class NoEdit(EditRule):
    GUARANTEES = frozenset({"nothing"})  # zeros

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        return torch.zeros_like(ctx.editable)
