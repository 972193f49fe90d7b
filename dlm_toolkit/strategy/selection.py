"""Small tensor helpers shared by selection rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dlm_toolkit.strategy.base import StepContext


def top1(score: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the highest-``score`` allowed position of each row (none if none allowed).

    Ties break towards the lower position, as in :func:`topk_per_row` with ``k = 1`` (``argmax``
    returns the first maximal index, the one a stable descending sort ranks first; NaN counts as
    the largest in both): one argmax instead of a sort and a scatter.
    """
    return top1_of_masked(torch.where(allowed, score, float("-inf")), allowed)


def top1_of_masked(masked_score: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """:func:`top1` given ``masked_score``, the score already set to ``-inf`` outside ``allowed`` (a
    rule that needs that tensor anyway, e.g. to compare it with a threshold, saves the ``where``)."""
    best = masked_score.argmax(dim=1, keepdim=True)
    return allowed & (torch.arange(masked_score.shape[1], device=masked_score.device) == best)


def topk_per_row(score: torch.Tensor, allowed: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the ``k[b]`` highest-``score`` allowed positions of row b.

    Ties break towards the lower position (a stable sort), so results are deterministic.
    """
    masked_score = score.masked_fill(~allowed, float("-inf"))
    order = masked_score.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(score.shape[1], device=score.device).expand_as(order))
    return allowed & (rank < k[:, None])


def rank_and_quota(score: torch.Tensor, allowed: torch.Tensor, k: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
    """(B, W) bool: the ``k[b]`` best-``score`` allowed positions of row b (a quota), plus every
    allowed position whose ``score > threshold`` when a threshold is given (parallel commits)."""
    out = topk_per_row(score, allowed, k)
    if threshold is not None:
        out = out | (allowed & (score > threshold))
    return out


def at_least_one(select: torch.Tensor, score: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``select`` plus, in rows where it is empty but ``allowed`` is not, the best-``score`` position."""
    need = allowed.any(1) & ~select.any(1)
    return select | (top1(score, allowed) & need[:, None])


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """(B, W) Shannon entropy in nats of ``(B, W, V)`` probabilities (0 log 0 = 0)."""
    return torch.special.entr(probs).sum(-1)


def top2_margin(probs: torch.Tensor) -> torch.Tensor:
    """(B, W) top-1 minus top-2 probability (Dream's ``topk_margin``)."""
    top = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    return top[..., 0] - top[..., -1] if top.shape[-1] > 1 else top[..., 0]


def remaskable(ctx: StepContext) -> torch.Tensor:
    """(B, W) positions a remask rule may pick without stalling the decode: written, non-prompt,
    not edited now, inside the *active* block (M2T can refill them), in rows whose block has masks."""
    edited = ctx.edit if ctx.edit is not None else torch.zeros_like(ctx.editable)
    return (ctx.editable > edited) & ctx.in_block & ctx.fillable.any(1)[:, None]  # a > b: a & ~b on bools


def remask_budget(ctx: StepContext) -> torch.Tensor:
    """(B,) most positions a remask rule may pick per row: commits of this step minus one."""
    commits = ctx.commit.sum(1) if ctx.commit is not None else torch.zeros(ctx.batch_size, dtype=torch.long, device=ctx.device)
    return (commits - 1).clamp(min=0)


# -- per-position memory for stateful rules -------------------------------------------------
# Rows move through blocks at different times and windows move between steps, so stateful rules
# key what they remember by batch row (``ctx.rows``) and absolute position (``ctx.positions``).
# The memory is dense over every batch row ({"positions": (N, M) long, -1 = empty slot,
# name: (N, M, ...)}), so storing and looking up are gathers on the device, with no host sync.


def remember(old: dict | None, ctx: StepContext, keep: torch.Tensor, **values: torch.Tensor) -> dict:
    """New memory holding ``values`` at the ``keep`` positions of every context row; batch rows not
    forwarded now keep their old entry. ``old`` is not modified (a rule's memory is a value, not a
    shared object)."""
    b, w = ctx.positions.shape
    slots = max(w, old["positions"].shape[1]) if old else w

    def widen(t: torch.Tensor, fill: float) -> torch.Tensor:  # (N, M, ...) -> (N, slots, ...)
        pad = slots - t.shape[1]
        return torch.cat([t, t.new_full((t.shape[0], pad, *t.shape[2:]), fill)], 1) if pad else t.clone()

    def fresh(t: torch.Tensor) -> torch.Tensor:  # (B, W, ...) -> an empty (N, slots, ...)
        return t.new_zeros((ctx.batch_rows, slots, *t.shape[2:]))

    live = ctx.live

    def put(table: torch.Tensor, rows_value: torch.Tensor) -> torch.Tensor:  # rows not forwarded keep theirs
        shaped = live.view(-1, *[1] * (table.dim() - 1))
        table[ctx.rows] = torch.where(shaped, rows_value, table[ctx.rows])
        return table

    positions = widen(old["positions"], -1) if old else torch.full(
        (ctx.batch_rows, slots), -1, dtype=torch.long, device=ctx.device)
    new = {"positions": put(positions, widen(torch.where(keep, ctx.positions, -1), -1))}
    for name, v in values.items():
        table = widen(old[name], 0) if old and name in old else fresh(v)
        new[name] = put(table, widen(v.to(table.dtype), 0))
    return new


def recall(old: dict | None, ctx: StepContext, name: str, fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, found)``: the remembered ``name`` at each (row, position) of the window, shaped
    ``(B, W) + fill.shape`` (``fill`` where nothing is remembered), and a ``(B, W)`` bool telling
    where something was remembered."""
    b, w = ctx.positions.shape
    default = fill.to(ctx.device).expand(b, w, *fill.shape)
    if not old or name not in old:
        return default.clone(), torch.zeros(b, w, dtype=torch.bool, device=ctx.device)
    stored = old["positions"][ctx.rows]  # (B, M)
    match = (ctx.positions[:, :, None] == stored[:, None, :]) & (stored[:, None, :] >= 0)  # (B, W, M)
    found = match.any(-1)
    slot = match.long().argmax(-1)  # (B, W)
    table = old[name][ctx.rows]  # (B, M, ...)
    index = slot.view(b, w, *[1] * fill.dim()).expand(b, w, *fill.shape)
    got = table.gather(1, index).to(default.dtype)
    return torch.where(found.view(b, w, *[1] * fill.dim()), got, default), found
