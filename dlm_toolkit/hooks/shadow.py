"""Shadow blocks (WINO, arXiv 2507.18578): a rule may read how much the model supports each written
token of the active block *with that token hidden*, from the step's own forward.

A role option, not a new role: a rule (any role) that also subclasses :class:`Shadow` asks for it.
Policies, configs and every existing rule are unchanged (a policy without a ``Shadow`` rule never
runs this module, and its forwards are exactly as before).

The engine appends a *shadow block* to every step's forward: one mask token at each absolute
position of the active block, after the window. Attention (block-causal models):

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

from dlm_toolkit.hooks.dynamic_blocks import require_fixed_blocks
from dlm_toolkit.config import ConfigError
from dlm_toolkit.hooks.base import StepHook

if TYPE_CHECKING:
    from dlm_toolkit.step.engine import StepEngine
    from dlm_toolkit.models.base import DiffusionLM
    from dlm_toolkit.strategy.policy import DecodingPolicy
    from dlm_toolkit.step.state import DecodeState
    from dlm_toolkit.strategy.base import StepContext

ROLES = ("m2t", "t2t", "remask")


class Shadow:
    """Mixin of a rule that reads ``ctx.shadow_confidence`` (module docstring). The engine fills it
    for every step of a policy with such a rule; nothing else changes for the rule."""

    def step_hooks(self, policy: DecodingPolicy, role: str) -> list[StepHook]:
        """The shadow-block hook (one per policy, however many of its rules read it)."""
        return [ShadowHook(f"{role} rule '{getattr(self, 'name', type(self).__name__)}'")] if role in ROLES else []


class ShadowHook(StepHook):
    """The shadow block as a step hook: the engine appends it to every forward, and after the
    forward ``ctx.shadow_confidence`` is filled from its logits (module docstring)."""

    def __init__(self, who: str):
        self.name = who  # the first rule that reads the shadow block

    def key(self) -> str:
        return "shadow"

    def check_policy(self, policy: DecodingPolicy) -> None:
        # the shadow block copies the block of length block_length starting at the block's start
        require_fixed_blocks(policy.blocks, f"{self.name} (a shadow block)")

    def check_model(self, model: DiffusionLM) -> None:
        """Refuse a full-attention model."""
        if model.attention != "block_causal":
            raise ConfigError(f"{self.name} reads a shadow block, which copies the active block's attention group; "
                              f"this model's attention is '{model.attention}' (a block-causal model is needed)")

    def engine_options(self) -> dict[str, bool]:
        return {"shadow": True}

    def after_forward(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        if engine.shadow_logits is not None:
            ctx.shadow_confidence = shadow_confidence(ctx, engine.shadow_logits, state)


def add_shadow(state: DecodeState, blocks: object, live: torch.Tensor, pos: torch.Tensor, real: torch.Tensor,
               group: torch.Tensor, ids: torch.Tensor, allowed: torch.Tensor, seen: torch.Tensor | None,
               write: torch.Tensor | None, in_cache: torch.Tensor | None, cache_group: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The forward's inputs with the shadow block appended: ``(ids, pos, allowed, seen, write,
    shadow_real)`` (module docstring). ``pos`` / ``real`` / ``group`` (N, T): the window's absolute
    positions, real slots and attention groups; ``allowed`` (N, T, T); with the KV cache ``seen``
    (N, T, S), ``write`` (N, T), ``in_cache`` / ``cache_group`` (N, S) as the engine built them."""
    s = state
    n, t = pos.shape
    bl = s.block_length
    lo, hi = s.block_bounds(s.all_rows)
    spos = lo[:, None] + torch.arange(bl, device=pos.device)  # (N, bl)
    sreal = live[:, None] & (spos < hi[:, None])
    spos = spos.clamp(0, s.canvas.shape[1] - 1)
    sgroup = blocks.attention_groups(s, s.all_rows, spos)  # type: ignore[attr-defined]
    # shadow query i: the window keys its block may see, minus the key at its own position
    to_window = (real[:, None, :] & sreal[:, :, None] & (group[:, None, :] <= sgroup[:, :, None])
                 & (pos[:, None, :] != spos[:, :, None]))  # (N, bl, T)
    to_shadow = (sreal[:, None, :] & sreal[:, :, None]) | torch.eye(bl, dtype=torch.bool, device=pos.device)
    top = torch.cat([allowed, allowed.new_zeros(n, t, bl)], 2)  # window queries never see the shadow
    allowed = torch.cat([top, torch.cat([to_window, to_shadow], 2)], 1)
    ids = torch.cat([ids, torch.full_like(spos, s.mask_token_id)], 1)
    pos = torch.cat([pos, spos], 1)
    if seen is not None:
        assert write is not None and in_cache is not None and cache_group is not None
        shadow_seen = in_cache[:, None, :] & sreal[:, :, None] & (cache_group[:, None, :] <= sgroup[:, :, None])
        seen = torch.cat([seen, shadow_seen[:, :, :seen.shape[2]]], 1)
        write = torch.cat([write, torch.zeros_like(sreal)], 1)  # the shadow is never cached
    return ids, pos, allowed, seen, write, sreal


def shadow_confidence(ctx: StepContext, shadow_logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """(B, W) float32: the shadow's probability of each written token of the active block (0 elsewhere).
    ``shadow_logits`` (N, block_length, V): the shadow block's logits of every batch row."""
    lo, _ = state.block_bounds(ctx.rows)
    index = (ctx.positions - lo[:, None]).clamp(0, shadow_logits.shape[1] - 1)  # (B, W)
    logits = shadow_logits[ctx.rows].gather(1, index[:, :, None].expand(-1, -1, shadow_logits.shape[-1]))
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, ctx.tokens[:, :, None]).squeeze(-1)
    written = ctx.in_block & ctx.valid & ~ctx.masked & ~ctx.is_prompt
    return torch.where(written, probs, 0.0)
