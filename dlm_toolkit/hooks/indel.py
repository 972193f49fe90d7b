"""Insert/delete edits (issue 26, hook c): a T2T rule may insert mask positions into, or delete
written tokens from, the active block; the block's content shifts and everything else stays put.

A role option, not a new role: a T2T rule that also subclasses :class:`Indel` asks for it.
Policies, configs and every existing rule are unchanged (a policy whose ``t2t`` is not an
``Indel`` never runs this module). Per step, after the engine wrote the step's commits, edits and
remasks (the rule's own ``__call__`` is its plain substitution edit):

1. ``rule.indel(ctx)`` -> ``(insert, delete)``, both ``(B, W)`` bool over the window:
   ``delete[b, j]`` removes the token at slot ``j``; ``insert[b, j]`` puts one mask token before the
   token at slot ``j``. ``ctx.commit`` / ``edit`` / ``remask`` are this step's selections;
   :func:`written_window` gives the window as the write left it.
2. :func:`indel_step` applies them (:func:`shift_block`) to the canvas as the write left it.

Semantics:

- **Where.** Only in the *generated part of the active block* (:func:`indel_region`: valid,
  non-prompt slots of live rows inside ``[block_lo, block_hi)``, the bounds
  :meth:`~dlm_toolkit.step.state.DecodeState.block_bounds` gives, so dynamic blocks work too). A delete
  must hit a written (non-mask) token. A selection elsewhere is the rule's error.
- **The shift.** Walking the region's slots in order, emit a mask if ``insert[j]``, then the token
  at ``j`` (with its ``written_step`` / ``written_conf``) unless ``delete[j]``; pad the region's end
  with masks (``written_step`` -1, confidence 0). The block keeps its length and the canvas its
  size; the prompt, earlier blocks, later blocks and the KV cache (which holds only positions
  before the active block) are untouched; tokens keep their provenance when they move.
- **Overflow.** An insert pushes the block's content right; what falls off the block's end must
  be masks. If a written token would fall off, nothing of that row's step is shifted and the row is
  flagged on the device; the engine raises at its next host read one :class:`StrategyError` naming
  the rule, the batch row, the block and the position (a token is never lost silently). Selections
  outside the region, and deletes of masks, are flagged and raised the same way. Wrong types or
  shapes are refused at once (metadata, no host read).
- **Convergence.** A row whose block an insert/delete changed is not a converged post step: its
  ``ctx.post`` is cleared after the shift, so a schedule's "a post step without edits ends the
  block" test (``semi_ar``, dynamic blocks) does not end a block that just gained a mask.
- **Bound.** A delete adds a mask to the block, which costs at most one more forward (every step
  with a mask commits one). The per-block forward bound of a policy with an ``Indel`` rule is the
  schedule's plus :meth:`Indel.max_indel_forwards`; the rule must keep its deletes per block within
  it (a rule that deletes forever trips the bound, with an error, instead of looping).
- **Accounting.** Counters ``inserts`` and ``deletes`` (per row; :class:`~dlm_toolkit.step.state.RowResult`);
  ``block_masked`` follows the shift (a delete adds a mask, an insert adds one and pushes one
  out). Trajectories record the applied selections (``StepRecord.insert`` / ``delete``, absolute
  positions before the shift); ``block_after`` is the block after the shift.

Fully vectorised: no host reads (the engine's one read carries the error flag). The shift is a
scatter: a kept token's target slot is ``j + cumsum(insert)[j] - (cumsum(delete)[j] - delete[j])``
(rank in the region), into a mask-filled buffer one wider than the window whose extra slot catches
what falls off (and every slot outside the region).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dlm_toolkit.step.canvas import window_values, write_shift
from dlm_toolkit.step.canvas import written_window  # noqa: F401  (rules read it as indel.written_window)
from dlm_toolkit.config import ConfigError
from dlm_toolkit.step.flags import DeviceFlag, FlagHit, StrategyError, set_flag
from dlm_toolkit.hooks.base import Declaration, StepHook
from dlm_toolkit.step.state import DecodeState
from dlm_toolkit.strategy.base import StepContext
from dlm_toolkit.step.outputs import Output

if TYPE_CHECKING:
    from dlm_toolkit.decoding.policy import DecodingPolicy

# kinds of an insert/delete error (column 0 of the INDEL flag's payload)
BAD_INSERT, BAD_DELETE, OVERFLOW = 1, 2, 3


class Indel:
    """Mixin of an :class:`~dlm_toolkit.strategy.base.EditRule` that also inserts and deletes positions
    inside the active block (module docstring).

    Contract (checked by :class:`~dlm_toolkit.testing.IndelContract`): ``indel`` returns two
    ``(B, W)`` bool tensors selecting only slots of :func:`indel_region`, deletes only written
    tokens (of :func:`written_window`), never pushes a written token out of the block, is
    batch-invariant and deterministic; no state on ``self``.
    """

    def indel(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(insert, delete)``, both ``(B, W)`` bool: put a mask before slot ``j`` / remove the
        token at slot ``j``. Called after the step's write (``ctx.commit/edit/remask`` are set)."""
        raise NotImplementedError

    def max_indel_forwards(self, block_length: int) -> int:
        """Forwards the rule's deletes may add to one block (added to the schedule's per-block
        bound). Default: one per position of a block."""
        return block_length

    def step_hooks(self, policy: DecodingPolicy, role: str) -> list[StepHook]:
        """The insert/delete hook (refused by its policy check outside the T2T role)."""
        return [IndelHook(self)]


OUTPUTS = {"insert": Output(("B", "W"), torch.bool, "slots a mask was inserted before"),
           "delete": Output(("B", "W"), torch.bool, "slots whose token was deleted")}


class IndelHook(StepHook):
    """Insert/delete edits as a step hook: after the write, :func:`indel_step`; the rule's
    :meth:`~Indel.max_indel_forwards` adds to the per-block bound."""

    def __init__(self, rule: Indel):
        self.rule = rule
        self.name = f"t2t rule '{getattr(rule, 'name', type(rule).__name__)}'"

    def declare(self, policy: DecodingPolicy) -> Declaration:
        check_roles(policy)
        length = policy.blocks.block_length
        return Declaration(outputs=OUTPUTS, flags=[INDEL], forward_budget=self.rule.max_indel_forwards(length),
                           budget_source=f"max_indel_forwards({length})")

    def after_write(self, ctx: StepContext, state: DecodeState) -> None:
        indel_step(state, ctx, self.rule)


def check_roles(policy: DecodingPolicy) -> None:
    """Refuse :class:`Indel` on a rule of another role than T2T (the engine would never call it)."""
    for role in ("m2t", "remask", "blocks"):
        rule = getattr(policy, role)
        if isinstance(rule, Indel):
            raise ConfigError(f"{role} rule '{rule.name}' is an Indel (insert/delete edits), which only a t2t rule may "
                              "be: insert/delete edits run after the step's T2T edits")


def indel_region(ctx: StepContext) -> torch.Tensor:
    """(B, W) bool: the slots an insert/delete may select: valid, non-prompt, in the active block,
    of live rows (one contiguous run per row: the generated part of the block)."""
    return ctx.valid & ctx.in_block & ~ctx.is_prompt & ctx.live[:, None]


def region_end(region: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the last slot of each row's ``region`` (one contiguous run of slots per row)."""
    return region & ~torch.cat([region[:, 1:], torch.zeros_like(region[:, :1])], 1)


def shift_block(tokens: torch.Tensor, written_step: torch.Tensor, written_conf: torch.Tensor, region: torch.Tensor,
                insert: torch.Tensor, delete: torch.Tensor, mask_token_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply inserts and deletes to the ``region`` (per row one contiguous run of slots) of a
    window: ``(tokens, written_step, written_conf, overflow)``. Selections outside the region are
    ignored; ``overflow`` (B,) bool marks rows where a non-mask token would fall off the region's
    end; those rows come back unchanged."""
    b, w = tokens.shape
    ins, dele = insert & region, delete & region
    rank = region.long().cumsum(1) - 1  # a slot's index inside the region
    size = region.sum(1, keepdim=True)
    first = region.long().argmax(1, keepdim=True)
    target = rank + ins.long().cumsum(1) - (dele.long().cumsum(1) - dele.long())
    keep = region & ~dele
    fits = target < size
    overflow = (keep & ~fits & (tokens != mask_token_id)).any(1)
    # kept tokens have strictly increasing targets; everything else goes to the spill slot w
    dest = torch.where(keep & fits, first + target, w)

    def moved(values: torch.Tensor, fill: float) -> torch.Tensor:
        buf = values.new_full((b, w + 1), fill).scatter_(1, dest, values)
        return torch.where(region & ~overflow[:, None], buf[:, :w], values)

    return moved(tokens, mask_token_id), moved(written_step, -1), moved(written_conf, 0.0), overflow


def indel_step(state: DecodeState, ctx: StepContext, rule: Indel) -> None:
    """Ask ``rule`` for this step's inserts and deletes and apply them to ``state`` (after the
    step's write, before the block schedule reacts): canvas, provenance, counters, ``block_masked``,
    the error flag the engine reads; ``ctx.hooks.insert/delete`` get what was applied and ``ctx.post`` is
    cleared in rows whose block changed (module docstring)."""
    insert, delete = checked(rule, ctx, rule.indel(ctx))
    tokens, step, conf = window_values(state, ctx)
    region = indel_region(ctx)
    mask = state.mask_token_id
    bad_insert = insert & ~region
    bad_delete = delete & ~(region & (tokens != mask))
    bad = bad_insert.any(1) | bad_delete.any(1)
    insert, delete = insert & ~bad[:, None], delete & ~bad[:, None]
    new_tokens, new_step, new_conf, overflow = shift_block(tokens, step, conf, region, insert, delete, mask)
    applied = ~bad & ~overflow
    insert, delete = insert & applied[:, None], delete & applied[:, None]
    write_shift(state, ctx, region, tokens, new_tokens, new_step, new_conf, insert, delete)
    changed = (insert | delete).any(1)
    ctx.post = ctx.post & ~changed
    ctx.hooks.insert, ctx.hooks.delete = insert, delete
    flag(state, ctx, bad_insert, bad_delete, overflow, region)


def checked(rule: Indel, ctx: StepContext, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` if it is a pair of bool tensors shaped like the window, else a
    :class:`~dlm_toolkit.decoding.policy.StrategyError` naming the rule (shapes and dtypes: no host read)."""
    shape = tuple(ctx.tokens.shape)
    ok = isinstance(out, tuple) and len(out) == 2 and all(
        isinstance(t, torch.Tensor) and t.dtype == torch.bool and tuple(t.shape) == shape for t in out)
    if not ok:
        got = (", ".join(f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                         for t in out) if isinstance(out, tuple) else type(out).__name__)
        name = getattr(rule, "name", type(rule).__name__)
        raise StrategyError(f"t2t rule '{name}': indel() must return (insert, delete), two bool tensors of shape "
                            f"{shape}, got ({got})")
    return out


def flag(state: DecodeState, ctx: StepContext, bad_insert: torch.Tensor, bad_delete: torch.Tensor,
         overflow: torch.Tensor, region: torch.Tensor) -> None:
    """Set the :data:`INDEL` flag in the rows with an insert/delete error: (kind, block bounds,
    position) of each row's first, raised at the engine's next host read."""
    kind = torch.where(bad_insert.any(1), BAD_INSERT,
                       torch.where(bad_delete.any(1), BAD_DELETE, torch.where(overflow, OVERFLOW, 0)))
    # the position: the first slot selected outside, or the region's last slot (what falls off)
    last = region_end(region)
    where = torch.where((kind == BAD_INSERT)[:, None], bad_insert, torch.where((kind == BAD_DELETE)[:, None], bad_delete, last))
    position = ctx.positions.gather(1, where.long().argmax(1, keepdim=True))[:, 0]
    lo, hi = state.block_bounds(ctx.rows)
    hit, payload = kind > 0, torch.stack([kind, lo, hi, position], 1)
    if ctx.rows.shape[0] != state.batch_size:  # a context of some rows: into their batch rows
        hit = torch.zeros_like(state.done).index_copy_(0, ctx.rows, hit)
        payload = payload.new_zeros(state.batch_size, 4).index_copy_(0, ctx.rows, payload)
    set_flag(state, INDEL, hit, payload)


def indel_message(hit: FlagHit) -> str:
    """The message of a flagged insert/delete (the :data:`INDEL` flag's factory)."""
    kind, lo, hi, p = hit.payload
    block = f"the active block [{lo}, {hi}) of batch row {hit.row}"
    if kind == OVERFLOW:
        return (f"{hit.owner} inserted into {block} more masks than its end could absorb: "
                f"written tokens would be pushed out past position {p}, the block's last (an insert needs "
                "a mask at the block's end, or a delete, to make room)")
    what = "insert a mask before" if kind == BAD_INSERT else "delete"
    allowed = "a non-prompt position of the block" if kind == BAD_INSERT else "a written (non-mask) non-prompt token of the block"
    return (f"{hit.owner} asked to {what} position {p}, outside what {block} allows: an insert/delete "
            f"edit must select {allowed}")


# each row's first bad insert/delete edit: (kind, block lo, block hi, position); declared by IndelHook
INDEL = DeviceFlag("indel", indel_message, payload=4)
