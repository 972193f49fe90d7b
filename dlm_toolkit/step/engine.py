"""The forwards of a decode (:class:`StepEngine`): the one host read per step, the prefill, each
step's shapes, attention pattern and KV-cache writes, and the runner that executes the model.

Shape-static: every row of the batch takes part in every forward, rows that are not live ride
along with nothing real in them (their writes and counters are masked off), so the shapes of
a decode's forwards never depend on the data. The context window is
``blocks.window_width()`` positions; the forward spans it (KV cache on: a width of ``W``, or
``W + block_length`` when the window's start moved past the cached prefix, e.g. the first step of
a block writing the block before it; cache off: the whole canvas), with a KV cache of the whole
canvas (``S = cache.max_length``): the cached length is data in the attention mask, not a shape.
With the cache, the prompt's finished blocks enter it in one prefill forward before the first
step (not an NFE; its positions count in ``forward_tokens`` as before).

Host reads (the host waiting for the device): ONE per ``check_every`` steps (default every step),
a small vector read with one ``.tolist()``: whether any row is live, the widest span a row
needs from its cached prefix (which of the step widths the forward takes), whether the schedule
broke the window/cache rules, whether an insert/delete edit was flagged (:mod:`dlm_toolkit.hooks.indel`),
and the contract checks of the steps since the last read (a broken contract raises there, before
anything is returned). Nothing else in the loop reads the device: not the rules, the checks, the
canvas writes, the insert/delete shifts, the block ends or the random draws (counter-based,
:mod:`dlm_toolkit.step.rng`). The first read of a decode also gives the prefill's width. Recording a
trajectory reads every step.

Why every row forwards every step (behind ``live``) rather than the batch being compacted to the
rows still decoding: compaction needs the host to know which rows those are (a read) and gives
each step a different batch shape (a capture per count). The price is compute spent on finished
rows until the slowest row of the batch is done.
"""

from __future__ import annotations

import weakref
from time import perf_counter
from typing import Any, Literal

import torch

from dlm_toolkit.hooks import shadow as shadow_block
from dlm_toolkit.hooks.indel import raise_indel_error
from dlm_toolkit.models.base import DiffusionLM
from dlm_toolkit.strategy.policy import StepChecks, StrategyError
from dlm_toolkit.step.state import COUNTERS, DecodeState

FORWARD_TOKENS = COUNTERS.index("forward_tokens")
CaptureMode = Literal["eager", "compile", "cuda_graphs"]


_SHARED: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def shared(model: Any) -> dict[tuple, Any]:
    """Per-model store of what captured decodes reuse across calls: step runners and the KV
    buffers they capture, keyed by (what, batch bucket, width, canvas). Sweeps call decode()
    thousands of times; each (bucket, width, canvas) is captured once. Two captured decodes of one
    model must therefore not run at the same time (they would share the KV buffer)."""
    store = _SHARED.get(model)
    if store is None:
        store = _SHARED[model] = {}
    return store


class StepEngine:
    """The forwards of one decode: the host read, the prefill, each step's shapes, attention
    pattern and KV-cache writes, and the runner that executes the model (module docstring)."""

    def __init__(self, model: DiffusionLM, blocks: Any, state: DecodeState, cached: bool, mode: CaptureMode,
                 backend: str, trim: bool = False, shadow: bool = False):
        self.model, self.blocks, self.state, self.cached, self.mode = model, blocks, state, cached, mode
        self.backend = backend  # torch.compile's backend in mode "compile" (the decode module's COMPILE_BACKEND)
        self.shadow = shadow  # append a shadow block to every step's forward (dlm_toolkit.hooks.shadow)
        self.shadow_logits: torch.Tensor | None = None  # (N, block_length, V) of the last forward
        # Eager decodes that read the host every step have no capture to keep shapes for: each forward
        # then takes only the live rows, the cache columns some row has filled and (cache off) the
        # canvas up to the furthest window end: the same logits for every real query, with less work.
        self.trim = trim
        self.live_rows: torch.Tensor | None = None  # (trim) the rows live in the next forward
        self.needed = 0  # (trim) cache columns (cache on) or canvas positions (cache off) the next forward needs
        n, self.length = state.canvas.shape
        self.window_width, self.block_length = blocks.window_width(), blocks.block_length
        self.full = model.attention == "full"
        self.width = self.window_width if cached else self.length
        self.fresh = True  # the next forward follows a read (which chose self.width)
        self.prefilled = not cached
        self.eyes: dict[int, torch.Tensor] = {}
        self.overflow = torch.zeros((), dtype=torch.bool, device=state.device)  # a span wider than its forward
        self.canvas_pos = torch.arange(self.length, device=state.device).expand(n, -1)  # (N, L)
        if cached:
            key = ("kv", n, self.length)
            store = shared(model) if mode != "eager" else {}
            state.cache = store.get(key) or model.new_cache(n, self.length)
            store[key] = state.cache
            state.cache_len = torch.zeros(n, dtype=torch.long, device=state.device)

    # -- the host read --------------------------------------------------------------------
    def read(self, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, checks: StepChecks) -> bool:
        """The one host read: raise on a failed check; False when no row is live; else choose the
        next forward's width (and prefill the KV cache before the first step)."""
        s, blocks = self.state, self.blocks
        zero = torch.zeros((), dtype=torch.long, device=s.device)
        if self.cached:
            assert s.cache_len is not None
            boundary = blocks.cache_boundary(s, s.all_rows, lo, hi)
            start = s.cache_len if self.prefilled else boundary
            bad_cache = (live & ((lo < s.cache_len) | (boundary < s.cache_len) | (boundary > lo))).any()
            span = torch.where(live, hi - start, 0).max()
            prefill_to = torch.where(live, boundary, 0).max()
        else:
            bad_cache, span, prefill_to = zero.bool(), zero, zero
        too_wide = (live & (hi - lo > self.window_width)).any()
        needed = torch.where(live, start if self.cached else hi, 0).max() if self.trim and not self.full else zero
        bad_bounds = (live & s.bounds_error).any() if s.bounds_error is not None else zero.bool()
        bad_indel = s.indel_error[:, 0].amax() if s.indel_error is not None else zero
        head = torch.stack([live.any().long(), span, prefill_to, bad_cache.long(), too_wide.long(),
                            self.overflow.long(), needed, bad_bounds.long(), bad_indel])
        rows = live.long() if self.trim else zero[None][:0]
        host = torch.cat([head, rows, checks.pending(s.device).long()]).tolist()
        n_head = len(head)
        (any_live, span_n, prefill_n, bad, wide, over, needed_n, out_of_canvas, indel_failed) = host[:n_head]
        flags = host[n_head + len(rows):]
        if self.trim:
            self.needed = needed_n
            self.live_rows = torch.tensor([r for r, x in enumerate(host[n_head:n_head + len(rows)]) if x],
                                          device=s.device)
        checks.raise_if_failed(flags)
        if out_of_canvas:
            raise_bad_bounds(s, live, blocks.name)
        if indel_failed:
            raise_indel_error(s, checks.policy.t2t.name)
        if bad:
            raise StrategyError(
                f"block schedule '{blocks.name}' moved a window start back into the KV cache, or declared a cache "
                "boundary outside [cached length, window start]")
        if wide:
            raise StrategyError(f"block schedule '{blocks.name}' returned a window wider than its window_width() "
                                f"({self.window_width} positions)")
        if over:
            raise StrategyError(f"block schedule '{blocks.name}' moved its window more than one block past the KV "
                                "cache between host reads; decode with check_every=1")
        if not any_live:
            return False
        if not self.prefilled:
            self.prefill(live, boundary, prefill_n)
        if self.cached:  # the narrowest of W, W + block, or whole blocks that holds the span
            w, bl = self.window_width, self.block_length
            self.width = w if span_n <= w else max(w + bl, -(-span_n // bl) * bl)
        self.fresh = True
        return True

    def prefill(self, live: torch.Tensor, boundary: torch.Tensor, upto: int) -> None:
        """Write positions ``[0, boundary)`` of each live row into the KV cache in one eager forward
        (its width depends on the prompts, so it is not captured)."""
        s = self.state
        self.prefilled = True
        if upto <= 0:
            return
        bl = self.block_length
        width = min(-(-upto // bl) * bl, self.length)
        pos = self.canvas_pos[:, :width]
        real = live[:, None] & (pos < boundary[:, None])
        allowed = self.pattern(pos, real)
        no_cache = torch.zeros(*allowed.shape[:2], self.length, dtype=torch.bool, device=s.device)
        t0 = perf_counter()
        self.model.forward_window(s.canvas[:, :width], pos, torch.cat([no_cache, allowed], -1), cache=s.cache,
                                  cache_rows=s.all_rows, cache_write=real)
        s.model_time += perf_counter() - t0
        s.forward_calls += 1
        s.counts[:, FORWARD_TOKENS] += real.sum(1)
        s.cache_len = torch.where(live, boundary, s.cache_len)

    # -- one step's forward -----------------------------------------------------------------
    def pattern(self, pos: torch.Tensor, real: torch.Tensor,
                group: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T, T) bool attention among the forward's own positions: a real query sees the real keys
        the schedule's groups allow (every real key for full attention); a padding query sees only
        itself (no empty row, nothing that could leak into real positions). ``group``: the
        schedule's attention groups of ``pos`` when the caller has them."""
        t = pos.shape[1]
        allowed = real[:, None, :] & real[:, :, None]
        if not self.full:
            if group is None:
                group = self.blocks.attention_groups(self.state, self.state.all_rows, pos)
            allowed = allowed & (group[:, None, :] <= group[:, :, None])
        eye = self.eyes.get(t)
        if eye is None:
            eye = self.eyes[t] = torch.eye(t, dtype=torch.bool, device=pos.device)
        return allowed | eye

    def forward(self, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """Logits ``(N, W, V)`` of the window ``hi - W + [0, W)`` of every row (rows not live and
        positions before ``lo`` are padding)."""
        s, blocks = self.state, self.blocks
        rows = s.all_rows
        width = self.width if self.fresh or not self.cached else max(self.width, self.window_width + self.block_length)
        self.fresh = False
        if self.cached:  # the span ends at the window's end; before the cached length is padding
            assert s.cache_len is not None
            pos = hi[:, None] - width + torch.arange(width, device=s.device)
            real = live[:, None] & (pos >= s.cache_len[:, None])
            self.overflow |= (live & (hi - s.cache_len > width)).any()
        elif self.full:  # the row's whole canvas, left-padded so its last query is real
            pos = s.length[:, None] - self.length + self.canvas_pos
            real = live[:, None] & (pos >= 0)
        else:  # the whole canvas; positions from the window's end on are padding
            pos = self.canvas_pos
            if self.trim:  # up to the furthest window end (all later positions are padding)
                width = max(1, min(self.length, -(-self.needed // self.block_length) * self.block_length))
                pos = pos[:, :width]
            real = live[:, None] & (pos < hi[:, None])
        first = pos[:, :1]  # the span's start (may be negative: left padding)
        pos = pos.clamp(0, self.length - 1)
        ids = s.canvas.gather(1, pos)
        group = None if self.full else blocks.attention_groups(s, rows, pos)  # (N, T)
        allowed = self.pattern(pos, real, group)
        seen = write = in_cache = cache_group = None
        if self.cached:
            assert s.cache_len is not None and group is not None
            boundary = blocks.cache_boundary(s, rows, lo, hi)
            cache_group = blocks.attention_groups(s, rows, self.canvas_pos)  # (N, S)
            in_cache = self.canvas_pos < s.cache_len[:, None]
            seen = in_cache[:, None, :] & real[:, :, None] & (cache_group[:, None, :] <= group[:, :, None])
            if self.trim:  # only the columns some live row has filled
                seen = seen[:, :, :self.needed]
            write = real & (pos < boundary[:, None])
            s.cache_len = torch.where(live, boundary, s.cache_len)
        if self.shadow:  # WINO's shadow block after the window (dlm_toolkit.hooks.shadow)
            assert group is not None
            ids, pos, allowed, seen, write, shadow_real = shadow_block.add_shadow(
                s, blocks, live, pos, real, group, ids, allowed, seen, write, in_cache, cache_group)
            real = torch.cat([real, shadow_real], 1)
        run = self.runner(pos.shape[1])
        if seen is not None:
            assert write is not None
            args: tuple[torch.Tensor, ...] = (ids, pos, torch.cat([seen, allowed], -1), write)
        else:
            args = (ids, pos, allowed)
        t0 = perf_counter()
        if self.trim and self.live_rows is not None and len(self.live_rows) < s.batch_size:
            logits = self.forward_rows(self.live_rows, args)
        else:
            logits = run(*args)
        s.model_time += perf_counter() - t0
        s.forward_calls += 1
        s.counts[:, FORWARD_TOKENS] += real.sum(1)
        w = self.window_width
        if self.shadow:
            self.shadow_logits = logits[:, width:]
        index = (hi[:, None] - w + torch.arange(w, device=s.device) - first).clamp(0, width - 1)
        return logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))

    def forward_rows(self, keep: torch.Tensor, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """(trim) The forward of rows ``keep`` only, as logits of every row (rows left out: zeros;
        they are not live, so nothing of theirs is read)."""
        s = self.state
        part = tuple(a.index_select(0, keep) for a in args)
        if self.cached:
            ids, pos, allowed, write = part
            out = self.model.forward_window(ids, pos, allowed, cache=s.cache, cache_rows=keep, cache_write=write)
        else:
            out = self.model.forward_window(*part)
        logits = out.new_zeros((s.batch_size, *out.shape[1:]))
        return logits.index_copy_(0, keep, out)

    def runner(self, width: int) -> Any:
        """The callable that runs the model forward for this width: the model itself when eager, else
        a :class:`~dlm_toolkit.step.capture.StepRunner` kept per (mode, bucket, width, canvas)."""
        s, model = self.state, self.model
        if self.mode == "eager":
            if self.cached:
                return lambda ids, pos, allowed, write: model.forward_window(
                    ids, pos, allowed, cache=s.cache, cache_rows=s.all_rows, cache_write=write)
            return model.forward_window
        from dlm_toolkit.step.capture import StepRunner

        key = ("step", self.mode, s.batch_size, width, self.length, self.cached)
        store = shared(model)
        if key not in store:
            if self.cached:
                cache, rows = s.cache, s.all_rows

                def fn(ids, pos, allowed, write):
                    return model.forward_window(ids, pos, allowed, cache=cache, cache_rows=rows, cache_write=write)
            else:
                def fn(ids, pos, allowed):
                    return model.forward_window(ids, pos, allowed)
            store[key] = StepRunner(fn, f"model forward (batch {s.batch_size}, width {width}, canvas {self.length})",
                                    self.mode, backend=self.backend)
        return store[key]


def raise_bad_bounds(state: DecodeState, live: torch.Tensor, schedule: str) -> None:
    """The error for a dynamic block proposed outside ``[prompt_len, canvas length)`` or holding no
    position (host reads: only on the way to raising)."""
    assert state.bounds_error is not None and state.block_lo is not None and state.block_hi is not None
    r = int((live & state.bounds_error).nonzero()[0, 0])
    lo, hi, p, n = (int(t[r]) for t in (state.block_lo, state.block_hi, state.prompt_len, state.length))
    if lo < p:
        where = f"overlaps the prompt (positions [0, {p}))"
    elif hi <= lo:
        where = "is empty (it holds no position)"
    else:
        where = f"leaves the canvas [0, {n})"
    raise StrategyError(f"block schedule '{schedule}' proposed the active block [{lo}, {hi}) for batch row {r}, "
                        f"which {where}: a dynamic block must lie in [{p}, {n}) and hold at least one position")
