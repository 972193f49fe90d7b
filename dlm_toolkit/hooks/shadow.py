"""Shadow blocks (WINO, arXiv 2507.18578): a rule may read how much the model supports each written
token of the active block *with that token hidden*, from the step's own forward.

A role option, not a new role: a rule (any role) that also subclasses :class:`Shadow` asks for it.
Policies, configs and every existing rule are unchanged (a policy without a ``Shadow`` rule never
runs this module, and its forwards are exactly as before).

The hook appends a *shadow block* (:func:`shadow_segment`) to every step's forward: one mask token
at each absolute position of the active block, after the window. Attention (block-causal models):

- a window query never sees the shadow, so the window's logits, the sampling and the KV-cache
  writes are those of the forward without it (and nothing of the shadow is cached);
- shadow query ``i`` sees what a query of the active block sees (the cached prefix and the
  window's keys of its block group or earlier) *except the key at its own position*, plus every
  shadow position (all masks; WINO's layout) and itself.

So shadow query ``i`` gives ``p(x_i | block without x_i)``, and ``ctx.shadow_confidence`` (B, W)
float32 is, at each written (non-mask, non-prompt) slot of the active block, the shadow's
probability of the token there before the step (softmax of the raw logits, as
``ctx.token_confidence``); 0 elsewhere. The shadow is part of the same forward: no NFE is added,
``forward_tokens`` counts its positions (the compute it costs).

Limits: block-causal models only (a full-attention model has no block group to copy, refused by
:meth:`ShadowHook.check_model`), and fixed block layouts (a dynamic schedule's block moves and resizes, refused
when the policy is built, as for a verification forward); both with one message naming the rule.
Host reads: none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.hooks.base import Declaration, StepHook
from dlm_toolkit.step.segments import Keys, Segment
from dlm_toolkit.step.outputs import Output

if TYPE_CHECKING:
    from dlm_toolkit.decoding.engine import StepEngine
    from dlm_toolkit.models.base import DiffusionLM
    from dlm_toolkit.decoding.policy import DecodingPolicy
    from dlm_toolkit.step.state import DecodeState
    from dlm_toolkit.strategy.base import StepContext

ROLES = ("m2t", "t2t", "remask")


class Shadow:
    """Mixin of a rule that reads ``ctx.shadow_confidence`` (module docstring). The engine fills it
    for every step of a policy with such a rule; nothing else changes for the rule."""

    def step_hooks(self, policy: DecodingPolicy, role: str) -> list[StepHook]:
        """The shadow-block hook (one per policy, however many of its rules read it)."""
        return [ShadowHook(f"{role} rule '{getattr(self, 'name', type(self).__name__)}'")] if role in ROLES else []


OUTPUTS = {"shadow_confidence": Output(("B", "W"), torch.float32,
                                      "p(written token | its block without it); 0 elsewhere")}


class ShadowHook(StepHook):
    """The shadow block as a step hook: the engine appends it to every forward, and after the
    forward ``ctx.hooks.shadow_confidence`` is set from its logits (module docstring)."""

    def __init__(self, who: str):
        self.name = who  # the first rule that reads the shadow block

    def declare(self, policy: DecodingPolicy) -> Declaration:
        # one shadow block however many rules read it; it copies the block of length block_length
        # starting at the block's start
        return Declaration(outputs=OUTPUTS, key="shadow", needs_fixed_block="a shadow block")

    def check_model(self, model: DiffusionLM) -> None:
        """Refuse a full-attention model."""
        if model.attention != "block_causal":
            raise ConfigError(f"{self.name} reads a shadow block, which copies the active block's attention group; "
                              f"this model's attention is '{model.attention}' (a block-causal model is needed)")

    def step_segments(self, engine: StepEngine, state: DecodeState, live: torch.Tensor,
                      window: Segment) -> list[Segment]:
        return [shadow_segment(engine, state, live)]

    def after_forward(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        added = engine.segment_logits(self)
        if added:
            ctx.hooks.shadow_confidence = shadow_confidence(ctx, added[0], state)


def shadow_segment(engine: StepEngine, state: DecodeState, live: torch.Tensor) -> Segment:
    """The shadow block as a segment of the step's forward (module docstring): one mask token at
    each absolute position of the active block of every live row; it sees the cached prefix and
    the window's keys of its group or earlier except its own position, every shadow key, and is
    never cached; the window does not see it (the window's segment sees no other segment)."""
    s = state
    bl = s.block_length
    lo, hi = s.block_bounds(s.all_rows)
    spos = lo[:, None] + engine.arange(bl)  # (N, bl)
    sreal = live[:, None] & (spos < hi[:, None])
    spos = spos.clamp(0, s.canvas.shape[1] - 1)
    return Segment(torch.full_like(spos, s.mask_token_id), spos, sreal, engine.groups(spos),
                   see_primary=Keys.UP_TO, hide_own_position=True, see_self=Keys.ALL)


def shadow_confidence(ctx: StepContext, shadow_logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """(B, W) float32: the shadow's probability of each written token of the active block (0 elsewhere).
    ``shadow_logits`` (N, block_length, V): the shadow block's logits of every batch row."""
    lo, _ = state.block_bounds(ctx.rows)
    index = (ctx.positions - lo[:, None]).clamp(0, shadow_logits.shape[1] - 1)  # (B, W)
    logits = shadow_logits[ctx.rows].gather(1, index[:, :, None].expand(-1, -1, shadow_logits.shape[-1]))
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, ctx.tokens[:, :, None]).squeeze(-1)
    written = ctx.in_block & ctx.valid & ~ctx.masked & ~ctx.is_prompt
    return torch.where(written, probs, 0.0)
