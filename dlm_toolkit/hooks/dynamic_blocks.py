"""The dynamic-block hook: a block schedule that chooses each active block's start and length from
what the decode has seen (e.g. the confidences behind its commits), still block-causal and with an
exact KV cache.

A subclass implements two proposals, :meth:`DynamicBlockSchedule.first_bounds` (once per decode)
and :meth:`DynamicBlockSchedule.next_bounds` (after every step's writes); this base turns them into
everything the engine asks of a :class:`~dlm_toolkit.strategy.base.BlockSchedule`:

- **Shapes stay static.** The bounds are per-row data (``DecodeState.block_lo/block_hi``); the
  window is always ``window_width()`` wide (the largest block the schedule may propose), so a
  captured step is reused whatever the bounds are.
- **Block-causal attention.** Positions before the active block are *final* (a block only slides
  past positions that hold a token, and rules only write inside the active block). They attend as
  in a fixed layout: by their grid block of ``block_length`` (aligned like ``semi_ar``'s
  ``align: absolute``). The active block ``[lo, hi)`` is one group above all of them (it sees every
  earlier position and itself, bidirectionally); nothing earlier sees it.
- **Exact cache.** A grid block enters the KV cache once the active block starts past its end
  (``cache_boundary``: ``lo`` rounded down to the grid): its positions are final and attend only to
  final positions, so their keys never change. The final positions of the grid block the active
  block starts in are recomputed every forward until then (like DSB Cache's refreshed prefix
  window). Decoding with the cache on or off gives the same tokens and NFE.
- **Bad proposals.** Every proposal is checked where it is made (:meth:`set_bounds`): a block that
  starts inside the prompt, ends past the canvas, holds no position, is wider than the window or
  starts before the previous block's start (positions before it are final) sets the device flag
  :data:`BOUNDS` (with the proposal), which the engine's one host read turns into one error
  naming the schedule (:mod:`dlm_toolkit.step.flags`).
- **A hook.** The schedule asks for a :class:`DynamicBlocksHook` (``step_hooks``): it declares the
  flag and that it moves and resizes the active block, so the policy refuses, when it is built,
  the hooks that copy a fixed block (a verification forward, a shadow block).
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from dlm_toolkit.config import StrategyConfig
from dlm_toolkit.step.facts import UNKNOWN, StepFacts
from dlm_toolkit.step.flags import DeviceFlag, FlagHit, set_flag
from dlm_toolkit.hooks.base import Declaration, StepHook
from dlm_toolkit.step.state import DecodeState
from dlm_toolkit.strategy.base import BlockSchedule, StepContext


class DynamicBlockConfig(StrategyConfig):
    """What every dynamic schedule needs: the grid (and, for most, the first block's length), the
    largest block (the window width), post steps at the end of the canvas and EOS early stop."""

    block_length: int = Field(32, ge=1, le=4096, description="grid of finished positions; the smallest block")
    max_block_length: int = Field(64, ge=1, le=4096, description="the largest active block (the window width)")
    max_post_steps: int = Field(16, ge=0, le=1024, description="mask-free forwards allowed on the last block")
    eos_early_stop: bool = True

    @model_validator(mode="after")
    def _largest_holds_smallest(self) -> DynamicBlockConfig:
        if self.max_block_length < self.block_length:
            raise ValueError(f"max_block_length ({self.max_block_length}) must be >= block_length "
                             f"({self.block_length})")
        return self


class DynamicBlockSchedule(BlockSchedule):
    """Base of block schedules whose active block's bounds are data (see the module docstring).

    Subclasses implement :meth:`first_bounds` and :meth:`next_bounds`; both return per-row absolute
    ``(lo, hi)`` that must satisfy ``prompt_len <= lo < hi <= length`` and ``hi - lo <=
    window_width()``. ``next_bounds`` must never move ``lo`` back, nor past a masked position (the
    positions before ``lo`` are final from then on). Returning the current bounds unchanged while
    the block holds no mask lets the base run post steps there (only sensible on the last block).
    """

    Config = DynamicBlockConfig

    def step_hooks(self, policy: object, role: str) -> list[StepHook]:
        """The dynamic-blocks hook (its flag, and the refusal of hooks that need a fixed block)."""
        return [DynamicBlocksHook(self)] if role == "blocks" else []

    def window_width(self) -> int:
        return int(self.config.max_block_length)  # type: ignore[attr-defined]

    def max_forwards_per_block(self) -> int:
        # while lo stays put every forward commits a net position in [lo, lo + width)
        return self.window_width() + int(self.config.max_post_steps)  # type: ignore[attr-defined]

    # -- what a subclass proposes ------------------------------------------------------------
    def first_bounds(self, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N,)`` bounds of every row's first active block."""
        raise NotImplementedError

    def next_bounds(self, state: DecodeState, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N,)`` bounds after the step ``ctx`` was written to ``state.canvas`` (rows that were not
        live keep theirs whatever this returns)."""
        raise NotImplementedError

    # -- the BlockSchedule protocol --------------------------------------------------------------
    def layout(self, prompt_len: torch.Tensor, gen_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bl = self.block_length  # the grid: absolute, as LLaDA2 trains its blocks
        return torch.zeros_like(prompt_len), prompt_len // bl, -(-(prompt_len + gen_length) // bl)

    def set_bounds(self, state: DecodeState, lo: torch.Tensor, hi: torch.Tensor, update: torch.Tensor) -> None:
        """Take the proposal ``(lo, hi)`` for the rows where ``update`` holds, flag the ones outside
        ``[prompt_len, length)`` (the engine raises at its next read) and recount the block's masks."""
        assert state.block_lo is not None and state.block_hi is not None
        width = self.window_width()
        bad = update & ~state.done & ((lo < state.prompt_len) | (hi > state.length) | (hi <= lo)
                                      | (hi - lo > width) | (lo < state.block_lo))
        set_flag(state, BOUNDS, bad, torch.stack([lo, hi, state.block_lo, torch.full_like(lo, width)], 1), source=self)
        moved = update & (lo != state.block_lo)
        state.block_lo = torch.where(update, lo, state.block_lo)
        state.block_hi = torch.where(update, hi, state.block_hi)
        state.block = torch.div(state.block_lo - state.origin, self.block_length, rounding_mode="floor")
        zero = torch.zeros_like(state.post)
        state.post = torch.where(moved, zero, state.post)
        state.block_step = torch.where(moved, zero, state.block_step)
        masked = state.masked_in_block(state.all_rows)
        state.block_masked_start = torch.where(moved, masked, state.block_masked_start)
        state.block_masked = masked

    def prepare(self, state: DecodeState, facts: StepFacts = UNKNOWN) -> torch.Tensor:
        if state.block_lo is None:  # the first step of a decode: the schedule proposes its first block
            lo, hi = self.first_bounds(state)
            state.block_lo, state.block_hi, state.block_width = lo.clone(), hi.clone(), self.window_width()
            self.set_bounds(state, lo, hi, ~state.done)
        live = ~state.done
        no_mask = live & (state.block_masked == 0)
        state.post = state.post + no_mask.long()
        state.done |= no_mask & (state.post > self.config.max_post_steps)  # type: ignore[attr-defined]
        return ~state.done

    def window(self, state: DecodeState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return state.block_bounds(rows)

    def attention_groups(self, state: DecodeState, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert state.block_lo is not None and state.block_hi is not None
        origin = state.origin[rows, None]
        grid = torch.div(positions - origin, self.block_length, rounding_mode="floor")
        grid = torch.where(positions < origin, -1, grid)
        lo, hi = state.block_lo[rows, None], state.block_hi[rows, None]
        active = torch.div(lo - origin, self.block_length, rounding_mode="floor") + 1  # above every final one
        # positions past the block are never real in a forward; later groups keep them invisible
        return torch.where(positions < lo, grid, torch.where(positions < hi, active, active + 1 + positions - hi))

    def cache_boundary(self, state: DecodeState, rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        origin = state.origin[rows]
        return origin + torch.div(lo - origin, self.block_length, rounding_mode="floor") * self.block_length

    def finish_step(self, state: DecodeState, ctx: StepContext, facts: StepFacts = UNKNOWN) -> None:
        live = torch.zeros_like(state.done).index_put_((ctx.rows,), ctx.live)
        converged = torch.zeros_like(state.done).index_put_((ctx.rows,), ctx.post & ~ctx.edit.any(1))
        state.done |= live & converged  # a post step on the last block that edited nothing
        lo, hi = self.next_bounds(state, ctx)
        self.set_bounds(state, lo, hi, live & ~state.done)
        if self.config.eos_early_stop:  # type: ignore[attr-defined]
            # everything before the block is final: an EOS there ends the row's output
            final = state.generated_span(state.all_rows, state.block_lo)
            stop = live & ~state.done & ((state.canvas == state.eos_token_id) & final).any(1)
            state.eos_stopped |= stop
            state.done |= stop


class DynamicBlocksHook(StepHook):
    """Dynamic blocks as a step hook: the schedule does the work in its ``prepare`` / ``finish_step``
    (bounds as per-row data on the decode state); the hook declares the :data:`BOUNDS` flag and that
    the active block moves and resizes (:func:`~dlm_toolkit.hooks.base.check_combinations`)."""

    def __init__(self, schedule: DynamicBlockSchedule):
        self.name = f"block schedule '{schedule.name}'"

    def declare(self, policy: object) -> Declaration:
        return Declaration(key="dynamic_blocks", flags=[BOUNDS], moves_block=True)


def bounds_message(hit: FlagHit) -> str:
    """The message of a dynamic block proposed outside ``[prompt_len, canvas length)`` or holding no
    position (the :data:`BOUNDS` flag's factory; host reads: only on the way to raising)."""
    state, r = hit.state, hit.row
    lo, hi, before, width = hit.payload
    p, n = int(state.prompt_len[r]), int(state.length[r])
    if lo < p:
        where = f"overlaps the prompt (positions [0, {p}))"
    elif hi <= lo:
        where = "is empty (it holds no position)"
    elif hi > n:
        where = f"leaves the canvas [0, {n})"
    elif hi - lo > width:
        where = f"is {hi - lo} wide, more than the window (max_block_length {width})"
    else:
        where = f"moved back before the previous block's start {before} (the positions before that are final)"
    return (f"{hit.owner} proposed the active block [{lo}, {hi}) for batch row {r}, which {where}: a dynamic "
            f"block must lie in [{p}, {n}), hold 1 to {width} positions and never move back")


# a row's first bad proposal (lo, hi, the previous lo, the window width); declared by DynamicBlocksHook
BOUNDS = DeviceFlag("dynamic_bounds", bounds_message, payload=4)
