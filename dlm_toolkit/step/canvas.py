"""Every write of the canvas during a decode: ``state.canvas``, its provenance (``written_step``,
``written_conf``) and the counters that follow a write (the step counters, ``block_masked``).

The decode loop writes a step through :func:`write_step`; a verification reads the window as
drafted through :func:`drafted_canvas` (a copy, the decode state is untouched); an insert/delete
edit puts its shifted window back through :func:`write_shift`. A hook that changes the canvas
does it here too, so there is one place that knows how window slots map onto canvas positions.

Window slots and canvas positions: a step's window ``ctx.positions`` (B, W) may start before
position 0 or hold padding; :func:`window_slots` clamps every slot onto a canvas position and
names, for each slot, the slot of the window that holds that position. Every write there carries
that slot's value, so repeated indices (padding clamped onto a real position) always write the
same value and no host read is needed to find the real slots.
"""

from __future__ import annotations

import torch

from dlm_toolkit.step.context import StepContext
from dlm_toolkit.step.facts import StepFacts
from dlm_toolkit.step.state import COUNTERS, DecodeState

INSERTS, DELETES = COUNTERS.index("inserts"), COUNTERS.index("deletes")
STEP_COUNTERS = COUNTERS[:8]  # what write_step counts, in this order
assert STEP_COUNTERS == ("nfe", "commits", "edits", "remasks", "multi_commit_steps", "post_forwards",
                         "post_forwards_with_edit", "blocks_decoded")
WITH_REMASK_COLUMNS = tuple(range(len(STEP_COUNTERS)))  # write_step's counter rows, by column of COUNTERS
NO_REMASK_COLUMNS = tuple(c for c in WITH_REMASK_COLUMNS if STEP_COUNTERS[c] != "remasks")


def window_slots(ctx: StepContext, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(at_pos, same)``: the canvas position each window slot writes (padding clamps onto real
    positions) and the window slot holding that position, whose value every write there carries."""
    at_pos = ctx.positions.clamp(0, length - 1)
    return at_pos, (at_pos - ctx.positions[:, :1]).clamp(0, ctx.positions.shape[1] - 1)


def written_window(ctx: StepContext, wrote: torch.Tensor | None = None) -> torch.Tensor:
    """(B, W) long: the window's tokens as this step's write leaves them (commits and edits written,
    remasks applied; :func:`write_step` stores exactly this); ``ctx.tokens`` are the tokens before the step.
    ``wrote``: ``ctx.commit | ctx.edit`` when the caller has it."""
    assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
    wrote = torch.where(ctx.commit | ctx.edit if wrote is None else wrote, ctx.sampled, ctx.tokens)
    return wrote.masked_fill(ctx.remask, ctx.mask_token_id)


def window_values(state: DecodeState, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, written_step, written_conf)``, each (B, W): the canvas and its provenance at the
    window's slots as they are now (padding slots read the position they clamp onto)."""
    at_pos, _ = window_slots(ctx, state.canvas.shape[1])
    at = (ctx.rows[:, None], at_pos)
    return state.canvas[at], state.written_step[at], state.written_conf[at]


def write_window(state: DecodeState, ctx: StepContext, tokens: torch.Tensor, written_step: torch.Tensor,
                 written_conf: torch.Tensor, inside: bool = False) -> None:
    """Write the whole window of ``ctx``: tokens and provenance, each (B, W) (module docstring:
    padding slots carry the value of the slot of the position they clamp onto). ``inside``: the
    caller knows that every slot of every row lies in ``[0, Lmax)`` (no slot clamps, so no two
    slots share a position), for a context of every row in order."""
    if inside:
        assert ctx.rows is state.all_rows
        state.canvas.scatter_(1, ctx.positions, tokens)
        state.written_step.scatter_(1, ctx.positions, written_step)
        state.written_conf.scatter_(1, ctx.positions, written_conf)
        return
    at_pos, same = window_slots(ctx, state.canvas.shape[1])
    if ctx.rows is state.all_rows:  # every row in order: a scatter along the row (repeated slots carry one value)
        state.canvas.scatter_(1, at_pos, tokens.gather(1, same))
        state.written_step.scatter_(1, at_pos, written_step.gather(1, same))
        state.written_conf.scatter_(1, at_pos, written_conf.gather(1, same))
        return
    at = (ctx.rows[:, None], at_pos)
    state.canvas[at] = tokens.gather(1, same)
    state.written_step[at] = written_step.gather(1, same)
    state.written_conf[at] = written_conf.gather(1, same)


def write_step(state: DecodeState, ctx: StepContext, facts: StepFacts | None = None, no_remask: bool = False) -> None:
    """Write commits, edits and remasks of one step at once, and count them (live rows only).

    The whole window is written back (unselected positions with their old values), so no host
    sync is needed to find the selected ones (module docstring). ``facts``: this step's host facts
    (their window ends prove when no slot clamps). ``no_remask``: the caller knows ``ctx.remask``
    selects nothing (the policy's remask rule guarantees it and no hook replaces it:
    :attr:`~dlm_toolkit.decoding.policy.StepChecks.no_remask`), so no remask is applied.
    """
    assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
    rows, live = ctx.rows, ctx.live
    every = rows is state.all_rows  # the decode loop's context: no gathers or scatters by row
    ends = None if facts is None else facts.window_ends
    # precondition of the scatter without window_slots: the window of row r is hi_r - W + [0, W), inside
    # the canvas for every row when min hi >= W and max hi <= Lmax (this step's read), so no slot clamps
    inside = every and ends is not None and ends[0] >= ctx.positions.shape[1] and ends[1] <= state.canvas.shape[1]
    wrote = ctx.commit | ctx.edit
    step = state.counts_columns(0, 1) if every else state.nfe[rows, None]
    tokens = torch.where(wrote, ctx.sampled, ctx.tokens) if no_remask else written_window(ctx, wrote)
    written_step = torch.where(wrote, step, ctx.written_step)
    written_conf = torch.where(wrote, ctx.confidence, ctx.written_conf)
    if not no_remask:
        written_step.masked_fill_(ctx.remask, -1)
        written_conf.masked_fill_(ctx.remask, 0.0)
    write_window(state, ctx, tokens, written_step, written_conf, inside)
    n_commit, n_edit = ctx.commit.sum(1), ctx.edit.sum(1)
    # one row per context row, STEP_COUNTERS without "remasks" when no remask is applied (its column
    # then stays as it is); forward_tokens: counted by the forwards; inserts, deletes: by write_shift.
    # Bools promote to long in the stack. A row that is not live has no valid slot, so no region holds
    # a selection of it and its commits/edits/remasks are 0 (a rule that selects there anyway fails the
    # step checks, raised at the next read); ctx.post holds live rows only: only the block start needs
    # the live mask. logical_and(post, n_edit) is post & (n_edit != 0); block_step < live is live &
    # (block_step == 0), as block_step >= 0: one op each.
    counted = [live, n_commit, n_edit, n_commit >= 2, ctx.post, torch.logical_and(ctx.post, n_edit),
               ctx.block_step.lt(live)]
    if no_remask:
        columns, net = state.index(NO_REMASK_COLUMNS), n_commit
    else:
        n_remask = ctx.remask.sum(1)
        counted.insert(3, n_remask)
        columns, net = state.index(WITH_REMASK_COLUMNS), n_commit - n_remask  # both stay in the block
    step_counts = torch.stack(counted, 1)
    if every:
        state.counts.index_add_(1, columns, step_counts)
        state.block_masked -= net
        state.block_step += live
        return
    state.counts.index_put_((rows[:, None], columns), step_counts, accumulate=True)
    state.block_masked[rows] -= net
    state.block_step[rows] += live.long()


def write_shift(state: DecodeState, ctx: StepContext, region: torch.Tensor, before: torch.Tensor,
                tokens: torch.Tensor, written_step: torch.Tensor, written_conf: torch.Tensor,
                inserts: torch.Tensor, deletes: torch.Tensor) -> None:
    """Write an insert/delete shift of the window (:func:`dlm_toolkit.hooks.indel.shift_block`'s output:
    ``tokens``, ``written_step``, ``written_conf``, each (B, W)), count the applied ``inserts`` /
    ``deletes`` ((B, W) bool) and move ``block_masked`` by the masks the shift added to the
    ``region`` (``before``: the window's tokens before the shift)."""
    write_window(state, ctx, tokens, written_step, written_conf)
    state.counts[:, INSERTS:DELETES + 1].index_add_(0, ctx.rows, torch.stack([inserts.sum(1), deletes.sum(1)], 1))
    mask = state.mask_token_id
    state.block_masked[ctx.rows] += (region & (tokens == mask)).sum(1) - (region & (before == mask)).sum(1)


def drafted_canvas(canvas: torch.Tensor, ctx: StepContext, draft: torch.Tensor) -> torch.Tensor:
    """A copy of ``canvas`` with the window written as ``draft`` (padding slots clamp onto real
    positions and carry the value of the slot of that position, as :func:`write_window` does)."""
    at_pos, same = window_slots(ctx, canvas.shape[1])
    out = canvas.clone()
    out[ctx.rows[:, None], at_pos] = draft.gather(1, same)
    return out
