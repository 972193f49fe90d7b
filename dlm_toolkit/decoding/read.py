"""The engine's one host read per step (:meth:`~dlm_toolkit.decoding.engine.StepEngine.read`): what
it brings to the host, the flags it raises, and the :class:`~dlm_toolkit.step.facts.StepFacts` it returns.

Two ways to the same facts:

- :func:`read_every_row`, for an eager decode that reads every step (``engine.trim``): every row's
  window bounds, cached length, cache boundary, block, post counter and mask count, the live rows
  and the pending device flags, in one concatenation; the engine's own checks and the maxima over
  the live rows are then host arithmetic on those values (no device op but the one ``cat``);
- :func:`read_reduced`, for the rest (captured decodes, ``check_every`` > 1): the engine's checks
  become device flags and the maxima one masked max on the device, so that the read carries a
  few values whatever the batch.

Both raise the flags set since the last read first (earlier steps, the step checks and the hooks'
flags), then the engine's own (:data:`~dlm_toolkit.decoding.engine.ENGINE_FLAGS`: set at this read,
after the hooks' in the table's order), as one device slab would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from dlm_toolkit.step.facts import StepFacts
from dlm_toolkit.step.flags import DeviceFlag, board

if TYPE_CHECKING:
    from dlm_toolkit.decoding.engine import StepEngine
    from dlm_toolkit.decoding.policy import StepChecks


def _board(engine: StepEngine, checks: StepChecks) -> None:
    """The decode's flag board with the policy's table (the first read adopts it)."""
    s = engine.state
    if s.flags is None or s.flags.table is None:
        board(s).adopt(checks.policy.flags)


def _max_live(live: Sequence[int], values: Sequence[int], every: bool = False) -> int:
    """The device's ``where(live, values, 0).amax()`` on host values (0 stands in for a row that is
    not live, so the result is never below 0 unless every row is live). ``every``: the caller knows
    every row is live (``all(live)``), so the result is ``max(values)`` (pinned in
    ``tests/test_step_read.py``)."""
    if every:
        return max(values)
    return max(v if x else 0 for x, v in zip(live, values))


def read_every_row(engine: StepEngine, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, checks: StepChecks,
                   flags: Sequence[DeviceFlag]) -> StepFacts | None:
    """The read of an eager decode that reads every step (module docstring). ``flags``: the engine's
    three flags (cache rule, width, overflow), in the table's order."""
    s, blocks, n = engine.state, engine.blocks, engine.state.batch_size
    prefilled = engine.prefilled
    _board(engine, checks)
    parts = [live, hi, lo, s.post, s.block_masked, engine.overflow_rows]
    boundary = None
    if engine.cached:
        assert s.cache_len is not None
        boundary = blocks.cache_boundary(s, s.all_rows, lo, hi)
        parts += [s.cache_len, boundary]
    fixed = s.block_lo is None  # a fixed block layout: the block index keys the step context
    if fixed:
        parts.append(s.block)
    pending = s.flags.pending()
    host = torch.cat([*parts, *pending]).tolist()  # bools promote to long in the cat
    cols = [host[at:at + n] for at in range(0, len(parts) * n, n)]
    live_n, his, los, posts, masked, overflow = cols[:6]
    s.flags.raise_first(host[len(parts) * n:], s)  # what was set before this read comes first
    s.flags.consumed()
    checks.forget()
    width, w = engine.length, engine.window_width
    if engine.cached:
        lens, bounds = cols[6:8]
        starts = lens if prefilled else bounds
        bad_cache = [x and (a < c or b < c or b > a) for x, a, b, c in zip(live_n, los, bounds, lens)]
    else:
        starts = bounds = lens = [0] * n
        bad_cache = [False] * n
    too_wide = [x and b - a > w for x, a, b in zip(live_n, los, his)]
    if any(bad_cache) or any(too_wide) or any(overflow):  # (the usual step has no hit: no search)
        for flag, hits in zip(flags, (bad_cache, too_wide, overflow)):  # set at this read: after every earlier flag
            row = next((r for r, h in enumerate(hits) if h), None)
            if row is not None:
                s.flags.raise_host(flag, row, s, engine)
    every = all(live_n)  # precondition of _max_live's every: each row is live
    keep = tuple(range(n)) if every else tuple(r for r, x in enumerate(live_n) if x)
    if not keep:
        return None
    needed = 0
    if not engine.full:
        needed = _max_live(live_n, starts if engine.cached else his, every)
    if not engine.prefilled:
        assert boundary is not None
        engine.prefill(live, boundary, _max_live(live_n, bounds, every))
    if engine.cached:  # the narrowest of W, W + block, or whole blocks that holds the span
        span, bl = _max_live(live_n, [h - a for h, a in zip(his, starts)], every), engine.block_length
        width = w if span <= w else max(w + bl, -(-span // bl) * bl)
    live_t, his_t = tuple(live_n), tuple(his)
    key, moves = None, True
    if engine.reuse:  # not right after the prefill: it moved the cached lengths after they were read
        key = (width, needed, live_t, his_t, tuple(lens), tuple(bounds)) if prefilled else None
        moves = any(x and b != c for x, b, c in zip(live_n, bounds, lens))
    return StepFacts(read=True, post_max=_max_live(live_n, posts, every), post_any=any(x and m == 0 for x, m in
                                                                                zip(live_n, masked)),
                     width=width, needed=needed, live=keep, window_ends=(min(his), max(his)), layout_key=key,
                     cache_moves=moves, context_key=(live_t, his_t, tuple(los), tuple(cols[-1])) if fixed else None)


def read_reduced(engine: StepEngine, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, checks: StepChecks,
                 flags: Sequence[DeviceFlag]) -> StepFacts | None:
    """The read of any other decode (module docstring): the engine's checks as device flags, one masked
    max for span, prefill and the post facts."""
    s, blocks = engine.state, engine.blocks
    _board(engine, checks)
    if engine.cached:
        assert s.cache_len is not None
        boundary = blocks.cache_boundary(s, s.all_rows, lo, hi)
        start = s.cache_len if engine.prefilled else boundary
        if boundary is lo:  # the default boundary (the window start): the three tests are one
            bad_cache = live & (lo < s.cache_len)
        else:
            bad_cache = live & ((lo < s.cache_len) | (boundary < s.cache_len) | (boundary > lo))
        wanted = [hi - start, boundary]
    else:
        bad_cache = torch.zeros_like(live)
        wanted = []
    # the engine's three flags in one slab: one update per read instead of three
    s.flags.set_many(flags, torch.stack(
        [bad_cache, live & (hi - lo > engine.window_width), engine.overflow_rows], 1), source=engine)
    n_wanted = len(wanted)
    wanted += [s.post, s.block_masked == 0]  # the post facts (StepFacts.post_max, post_any), in the same max
    maxes = torch.where(live, torch.stack(wanted), 0).amax(1)
    host = torch.cat([live.any()[None], maxes, *s.flags.pending()]).tolist()  # bools promote to long
    span_n, prefill_n = host[1:3] if engine.cached else (0, 0)
    post_max, post_any = host[1 + n_wanted], bool(host[2 + n_wanted])
    s.flags.raise_first(host[len(wanted) + 1:], s)
    s.flags.consumed()
    checks.forget()
    if not host[0]:
        return None
    if not engine.prefilled:
        engine.prefill(live, boundary, prefill_n)
    width = engine.length
    if engine.cached:  # the narrowest of W, W + block, or whole blocks that holds the span
        w, bl = engine.window_width, engine.block_length
        width = w if span_n <= w else max(w + bl, -(-span_n // bl) * bl)
    return StepFacts(read=True, post_max=post_max, post_any=post_any, width=width)
