"""Remask ``none``: written tokens are never turned back into masks (all but ReMDM/WINO)."""

from __future__ import annotations

import torch

from dlm_toolkit import REMASK, RemaskRule, StepContext


@REMASK.register("none")
class NoRemask(RemaskRule):
    GUARANTEES = frozenset({"nothing"})  # zeros

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        return torch.zeros_like(ctx.editable)
