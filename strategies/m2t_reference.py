"""M2T ``reference``: the dependency-aware reference rule of the oracle models (issue 44).

Not from a paper: the yardstick the other rules are measured against on tasks whose answer
distribution is known (``--checkpoint oracle:TASK``, :mod:`dlm_toolkit.models.oracle`). Each step,
rank the masked positions of the active block by confidence and commit the longest prefix of that
ranking whose independently sampled tokens are jointly consistent with some valid answer with
probability >= 1 - ``eps``, computed exactly from the oracle's joint (at least one position, so
every step makes progress). Sweeping ``eps`` gives the reference speed-quality curve of a task.

What it is optimal for: among rules that draw every committed token independently from the exact
marginals of the current canvas (every marginal-only rule of the catalogue at temperature 1) and
choose which positions to commit from the canvas alone, before seeing the draws, it commits the
most positions a step can commit *along the confidence ranking* while keeping that step's risk of
an inconsistent answer <= eps. It is greedy per step: it does not minimise the forwards of the whole
decode at a given final accuracy (a rule may take more risk early and less later), and a set that
is not a prefix of the ranking may be larger at the same risk. Without edits, a decode's accuracy is
the product of its steps' consistency probabilities, so it is at least (1 - eps)^steps.

The joint is a capability of the model, not of the loop: the rule asks for a step hook
(:class:`JointHook`) which calls the model's ``joint_consistency`` (canvas, ranked positions) and
sets ``ctx.hooks.joint_consistency``; a model without it is refused in one line when the decode
starts. The hook reads the host (it is an oracle, on the CPU): one list per row and step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext, StrategyConfig, UnmaskRule
from dlm_toolkit.config import ConfigError
from dlm_toolkit.hooks.base import Declaration, StepHook
from dlm_toolkit.strategy.base import Output
from dlm_toolkit.strategy.selection import top1

if TYPE_CHECKING:
    from dlm_toolkit.models.base import DiffusionLM
    from dlm_toolkit.decoding.engine import StepEngine
    from dlm_toolkit.step.state import DecodeState
    from dlm_toolkit.decoding.policy import DecodingPolicy


class JointHook(StepHook):
    """After each forward: ``ctx.hooks.joint_consistency`` (B, W) float32, at each fillable slot the
    probability that it and every fillable slot ranked before it (confidence, descending; ties by
    slot) are jointly consistent when drawn independently; 0 elsewhere. From ``model.joint_consistency``."""

    def __init__(self, who: str) -> None:
        self.name = who

    def declare(self, policy: DecodingPolicy) -> Declaration:
        return Declaration(outputs={"joint_consistency": Output(
            ("B", "W"), torch.float32, "P(this slot and every better-ranked fillable slot drawn consistently)")},
            key="joint_consistency")

    def check_model(self, model: DiffusionLM) -> None:
        if not callable(getattr(model, "joint_consistency", None)):
            raise ConfigError(f"{self.name} needs a model that exposes its joint distribution (an oracle: "
                              f"--checkpoint oracle:TASK); {type(model).__name__} does not")

    def after_forward(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        fill = ctx.fillable
        score = torch.where(fill, ctx.confidence, -1.0)
        order = torch.sort(score, dim=1, descending=True, stable=True).indices  # (B, W)
        count = fill.sum(1).tolist()
        ranked = ctx.positions.gather(1, order)
        orders = [ranked[b, :count[b]].tolist() for b in range(len(count))]
        probs = engine.model.joint_consistency(state.canvas[ctx.rows], orders)
        out = torch.zeros(fill.shape, dtype=torch.float32, device=fill.device)
        for b, p in enumerate(probs):
            out[b, order[b, :count[b]]] = p.to(out)
        ctx.hooks.joint_consistency = out


@M2T.register("reference")
class ReferenceUnmask(UnmaskRule):
    class Config(StrategyConfig):
        eps: float = Field(0.05, ge=0.0, le=1.0,
                           description="commit the longest confidence-ranked prefix consistent with probability >= 1 - eps")

    def step_hooks(self, policy: DecodingPolicy, role: str) -> list[StepHook]:
        return [JointHook(f"{role} rule '{self.name}'")]

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        joint = ctx.hooks.get("joint_consistency")
        if joint is None:  # a context built by hand (no engine, no hook): the single best position
            return top1(ctx.confidence, ctx.fillable)
        commit = ctx.fillable & (joint >= 1.0 - self.config.eps)
        # prefix probabilities never rise along the ranking: the set above is the longest such prefix
        return commit | (top1(joint, ctx.fillable) & ~commit.any(1, keepdim=True))
