"""T2T ``freeze_first``: the threshold edit rule plus a step hook with a constructor parameter.

The hook, :class:`FreezeFirst`, keeps the first ``frozen`` positions of the active block as they were
written (no edit, no remask there). ``frozen`` reaches it from a policy file the way every rule
parameter does: it is a field of the rule's ``Config`` (``t2t.params.frozen``, also settable with
``--set`` and searchable in a sweep), and the rule's ``step_hooks`` builds the hook with it.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import T2T, StepContext
from dlm_toolkit.hooks import Declaration, StepHook

ThresholdEdit = T2T.get("threshold")


class FreezeFirst(StepHook):
    """After the rules: no edit or remask at the first ``frozen`` positions of the active block."""

    def __init__(self, frozen: int) -> None:
        self.frozen = frozen  # configuration, fixed when the policy is built; a decode never changes it

    def declare(self, policy: object) -> Declaration:
        return Declaration(key=("freeze_first", self.frozen))  # two rules asking for one freeze get one hook

    def after_rules(self, ctx: StepContext, engine: object, state: object) -> None:
        rank = ctx.in_block.long().cumsum(1)  # 1, 2, ... along the active block
        frozen = ctx.in_block & (rank <= self.frozen)
        ctx.edit = ctx.edit & ~frozen
        ctx.remask = ctx.remask & ~frozen


@T2T.register("freeze_first")
class FreezeFirstEdit(ThresholdEdit):
    class Config(ThresholdEdit.Config):
        frozen: int = Field(1, ge=1, le=4096, description="positions at the start of the active block never edited")

    def step_hooks(self, policy: object, role: str) -> list[StepHook]:
        return [FreezeFirst(self.config.frozen)]
