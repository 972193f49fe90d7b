"""Verification forwards (issue 26, hook a): a rule drafts a step's writes, the engine runs one more
forward of the model over that draft, and the rule keeps the drafted writes the verifier accepts.

A role option, not a new role: an M2T rule that also subclasses :class:`Verifier` asks for it.
Policies, configs and every existing rule are unchanged (a policy whose ``m2t`` is not a
``Verifier`` never runs this module). Per step, after the policy's rules chose ``commit`` /
``edit`` / ``remask`` (the rule's own ``__call__`` is its no-verification fallback):

1. ``verifier.wants_verify(ctx)`` -> ``(B,)`` bool: the rows that verify now;
2. ``verifier.draft(ctx)`` -> ``(B, W)`` long: the window as the draft would write it;
3. the engine runs the *verification forward* (:func:`verify_forward`) for those rows;
4. ``verifier.accept(ctx, draft, verify_logits)`` -> ``(commit, tokens)``: the positions written in
   those rows and their tokens (a rejected draft position may be written with another token).

The verification forward is the block-diffusion model in its autoregressive mode (block size one),
as S2D2 (arXiv 2603.25702) uses it: the same step runner gets ``[draft | masked copy]``, the span of
the step's forward with the draft written, followed by a copy of the active block holding only mask
tokens at the same absolute positions. Attention inside the active block is token-causal (each
position its own block); copy position ``i`` sees the cached prefix, the draft strictly before
``i`` (never the draft token at ``i`` itself) and itself, so its logits are ``p_AR(x_i | prefix,
draft_<i)`` for every ``i`` of the block in one forward. Nothing is written to the KV cache (its
prefix holds finished blocks only), so decodes with and without the cache stay equal.

Accounting: a verification forward is one NFE of every row that verifies (``nfe``, its
``forward_tokens``, the block's forward count that the per-block bound checks) and one
``forward_calls``; trajectories mark the step ``verified``. The per-block bound of a policy with a
verifier is the schedule's plus ``verifier.max_verify_forwards(block_length)``; a row that verifies
past it stops the decode with a message naming the rule.

Shapes: with the KV cache the forward is ``window_width() + block_length`` wide, a width the step
already captures; without it, the canvas plus one block (one more captured width per decode).
Full-attention models have no autoregressive mode and are refused. With the cache, the forward
spans the ``window_width()`` positions ending at the window's end: that holds everything not yet
cached for schedules whose cache boundary is the window start (the default; semi-AR and multi-block
editing), which is what the per-step forward left in the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dlm_toolkit.step import rng
from dlm_toolkit.step.canvas import drafted_canvas
from dlm_toolkit.config import ConfigError
from dlm_toolkit.hooks.base import Declaration, StepHook
from dlm_toolkit.step.segments import Keys, Segment
from dlm_toolkit.strategy.base import StepContext
from dlm_toolkit.step.outputs import Output

if TYPE_CHECKING:
    from dlm_toolkit.decoding.engine import StepEngine
    from dlm_toolkit.models.base import DiffusionLM
    from dlm_toolkit.decoding.policy import DecodingPolicy
    from dlm_toolkit.step.state import DecodeState

VERIFY_DRAW = 1 << 12  # draw index of a verifier's random numbers: apart from the rules' own draws


class Verifier:
    """Mixin of an :class:`~dlm_toolkit.strategy.base.UnmaskRule` that asks for a verification forward.

    Contract (checked by :class:`~dlm_toolkit.testing.VerifierContract`): ``accept`` writes only
    fillable positions of the rows that verify, at least one per row with a mask, never the mask
    token, never a drafted token the verify forward gives probability 0 (a write it rejected), and
    nothing else; no state on ``self``; random numbers only from :func:`verify_uniform`.
    """

    def wants_verify(self, ctx: StepContext) -> torch.Tensor:
        """``(B,)`` bool: the rows that run a verification forward this step."""
        raise NotImplementedError

    def draft(self, ctx: StepContext) -> torch.Tensor:
        """``(B, W)`` long: the window as drafted. Default: this step's edits applied and every
        fillable position filled with ``ctx.sampled``."""
        assert ctx.edit is not None
        return torch.where(ctx.fillable | ctx.edit, ctx.sampled, ctx.tokens)

    def accept(self, ctx: StepContext, draft: torch.Tensor, verify_logits: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(commit (B, W) bool, tokens (B, W) long)`` for the rows that verify, from the verify
        forward's logits ``(B, W, V)`` (a window position of the active block: ``p_AR`` of that
        position; elsewhere: unspecified, do not read)."""
        raise NotImplementedError

    def max_verify_forwards(self, block_length: int) -> int:
        """Verification forwards one block may add to the schedule's per-block bound. Default: one per
        position (a rule that commits at least one position per verified step needs no more)."""
        return block_length

    def step_hooks(self, policy: DecodingPolicy, role: str) -> list[StepHook]:
        """The verification hook, for the policy's M2T rule only (a verifier in another role is inert)."""
        return [VerifyHook(self, policy.m2t.name, policy.sampling.temperature)] if role == "m2t" else []


OUTPUTS = {
    "verified": Output(("B",), torch.bool, "rows that ran a verification forward this step"),
    "draft": Output(("B", "W"), torch.long, "the window as drafted"),
    "verify_logits": Output(("B", "W", "V"), "logits", "the verification forward's logits"),
    "temperature": Output((), float, "the policy's sampling temperature"),
}


class VerifyHook(StepHook):
    """The verification forward as a step hook: after the rules, draft, verify and accept
    (:func:`verify_step`); its forwards count towards the per-block bound."""

    def __init__(self, verifier: Verifier, rule_name: str, temperature: float):
        self.verifier, self.rule_name, self.temperature = verifier, rule_name, temperature
        self.name = f"m2t rule '{rule_name}'"

    def declare(self, policy: DecodingPolicy) -> Declaration:
        length = policy.blocks.block_length
        # the verification forward copies the block of length block_length starting at the block's start
        # and assumes the cache ends at the window start: a block that moves and grows breaks both
        return Declaration(outputs=OUTPUTS, forward_budget=self.verifier.max_verify_forwards(length),
                           budget_source=f"max_verify_forwards({length})", needs_fixed_block="a verification forward")

    def check_model(self, model: DiffusionLM) -> None:
        """Refuse a full-attention model (it has no autoregressive mode to verify with)."""
        if model.attention != "block_causal":
            raise ConfigError(f"{self.name} verifies with the model's autoregressive mode (block size one), which "
                              f"needs a block-causal model; this model's attention is '{model.attention}'")

    def after_rules(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        verify_step(engine, self.verifier, ctx, self.temperature)


def verify_uniform(ctx: StepContext, *trailing: int, dtype: torch.dtype = torch.float32, draw: int = 0) -> torch.Tensor:
    """Uniforms in [0, 1) for a verifier, keyed like :meth:`StepContext.rand` (row seed, row step,
    position) with draw index ``VERIFY_DRAW + draw``, so they do not depend on how many numbers the
    rules drew before."""
    return rng.uniform(rng.key(ctx.seeds, ctx.step, ctx.positions, VERIFY_DRAW + draw), trailing, dtype)


def verify_step(engine: StepEngine, verifier: Verifier, ctx: StepContext, temperature: float) -> None:
    """Run the verification of one step: draft, verification forward, acceptance; replace the
    verifying rows' commits (and the tokens written there) in ``ctx`` and mark them ``ctx.hooks.verified``
    (with ``ctx.hooks.draft`` and ``verify_logits`` when a verification forward ran). ``temperature``: the
    policy's sampling temperature (``ctx.hooks.temperature``; :func:`sampling_temperature` reads it)."""
    assert ctx.commit is not None
    ctx.hooks.temperature = temperature
    rows = ctx.live & verifier.wants_verify(ctx)
    ctx.hooks.verified = rows
    if engine.mode == "eager" and not bool(rows.any()):  # a host read, but eager decodes read every step anyway
        return  # (captured decodes forward regardless: nothing real in it, no NFE counted)
    draft = verifier.draft(ctx)
    logits = verify_forward(engine, ctx, rows, draft)
    commit, tokens = verifier.accept(ctx, draft, logits)
    keep = rows[:, None]
    ctx.commit = torch.where(keep, commit, ctx.commit)
    ctx.sampled = torch.where(keep & commit, tokens, ctx.sampled)
    ctx.hooks.draft, ctx.hooks.verify_logits = draft, logits


def verify_forward(engine: StepEngine, ctx: StepContext, rows: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """Logits ``(N, W, V)`` of the autoregressive-mode forward over ``[draft | masked copy of the
    active block]`` (module docstring) for ``rows``; counted as one NFE of each of them
    (:meth:`~dlm_toolkit.decoding.engine.StepEngine.extra_forward`)."""
    drafted, copy = verify_segments(engine, ctx, rows, draft)
    _, logits = engine.extra_forward([drafted, copy], rows)
    block_lo, _ = engine.state.block_bounds(engine.state.all_rows)
    index = (ctx.positions - block_lo[:, None]).clamp(0, copy.width - 1)
    return logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))


def verify_segments(engine: StepEngine, ctx: StepContext, rows: torch.Tensor, draft: torch.Tensor
                    ) -> tuple[Segment, Segment]:
    """The verification forward's two segments (module docstring): the step's span with the draft
    written (token-causal inside the active block), and the masked copy of the active block, whose
    position ``i`` sees the cached prefix, the drafted keys strictly before ``i`` and itself."""
    s = engine.state
    n, bl = s.batch_size, s.block_length
    block_lo, _ = s.block_bounds(s.all_rows)
    canvas = drafted_canvas(s.canvas, ctx, draft)
    if engine.cached:  # the window's span: everything before it is in the cache by now
        assert s.cache_len is not None
        w = engine.window_width
        hi = ctx.positions[:, -1:] + 1
        pos1 = hi - w + engine.arange(w)
        real1 = rows[:, None] & (pos1 >= s.cache_len[:, None])
    else:  # the whole canvas, padding from the window's end on
        pos1 = engine.canvas_pos
        real1 = rows[:, None] & (pos1 <= ctx.positions[:, -1:])
    pos1 = pos1.clamp(0, engine.length - 1)
    pos2 = block_lo[:, None] + engine.arange(bl)
    real2 = rows[:, None].expand(n, bl)
    group1, group2 = engine.groups(pos1), engine.groups(pos2)
    assert group1 is not None and group2 is not None  # block-causal models only (check_model)
    # token-causal inside the active block: every position its own block (order key within the group)
    step = bl + 1
    key1 = group1 * step + torch.where((pos1 >= block_lo[:, None]) & (pos1 < block_lo[:, None] + bl),
                                       pos1 - block_lo[:, None] + 1, 0)
    key2 = group2 * step + (pos2 - block_lo[:, None] + 1)
    drafted = Segment(canvas.gather(1, pos1), pos1, real1, group1, order=key1, see_self=Keys.UP_TO)
    copy = Segment(torch.full_like(pos2, s.mask_token_id), pos2, real2, group2, order=key2,
                   see_primary=Keys.BEFORE, see_self=Keys.NONE)
    return drafted, copy


def sampling_temperature(ctx: StepContext) -> float:
    """The sampling temperature of the step (0 where nothing set it, e.g. a hand-built context)."""
    temperature = ctx.hooks.get("temperature")
    return 0.0 if temperature is None else float(temperature)


def temperature_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 softmax of ``logits / temperature`` (of the raw logits at temperature 0, as S2D2's
    acceptance ratio reads them)."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    return torch.softmax(scaled, dim=-1)
