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
needs from its cached prefix (which of the step widths the forward takes), and every device flag
set since (:mod:`dlm_toolkit.step.flags`: the contract checks of the steps since the last read, the
hooks' flags such as an insert/delete error or a dynamic block outside the canvas, and the
engine's own schedule errors; a set flag raises there, before anything is returned). Nothing
else in the loop reads the device: not the rules, the checks, the
canvas writes, the insert/delete shifts, the block ends or the random draws (counter-based,
:mod:`dlm_toolkit.step.rng`). The first read of a decode also gives the prefill's width. Recording a
trajectory reads every step.

Why every row forwards every step (behind ``live``) rather than the batch being compacted to the
rows still decoding: compaction needs the host to know which rows those are (a read) and gives
each step a different batch shape (a capture per count). The price is compute spent on finished
rows until the slowest row of the batch is done.

One forward primitive, :meth:`StepEngine.run`: a forward is a list of
:class:`~dlm_toolkit.step.segments.Segment` objects (the step's window span first, then what hooks
append: the shadow block; or a hook's own forward: the verification's drafted span and masked
copy), which it lays out into ids, positions and the attention mask (cache columns included), runs
through the runner of that width, times and counts (``forward_calls``, ``forward_tokens``, and for
a hook's own forward ``nfe`` and ``block_step`` of its rows). The engine knows no hook by name:
hooks add segments through the ``step_segments`` stage (:mod:`dlm_toolkit.hooks`) and read their
logits with :meth:`StepEngine.segment_logits`, or run :meth:`StepEngine.extra_forward`.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

import torch

from dlm_toolkit.decoding.read import read_every_row, read_reduced
from dlm_toolkit.step.facts import SavedLayout, StepFacts
from dlm_toolkit.step.flags import DeviceFlag, FlagHit, StrategyError, declare
from dlm_toolkit.models.base import DiffusionLM
from dlm_toolkit.step.segments import Segment, cache_seen, cache_writes, check, layout, plain_window, window_with_cache
from dlm_toolkit.step.state import COUNTERS, DecodeState
from dlm_toolkit.strategy.base import BlockSchedule
from dlm_toolkit.step.outputs import hook_label

if TYPE_CHECKING:
    from dlm_toolkit.decoding.policy import StepChecks

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
                 backend: str, trim: bool = False, segment_hooks: Sequence[tuple[Any, Callable[..., Any]]] = ()):
        self.model, self.blocks, self.state, self.cached, self.mode = model, blocks, state, cached, mode
        self.backend = backend  # torch.compile's backend in mode "compile" (the decode module's COMPILE_BACKEND)
        # (hook, its step_segments): segments appended to every step forward (dlm_toolkit.hooks)
        self.segment_hooks = list(segment_hooks)
        self.added: dict[int, list[torch.Tensor]] = {}  # by id(hook): its segment logits of the last step forward
        # Eager decodes that read the host every step have no capture to keep shapes for: each forward
        # then takes only the live rows, the cache columns some row has filled and (cache off) the
        # canvas up to the furthest window end: the same logits for every real query, with less work.
        self.trim = trim
        self.row_sets: dict[tuple[int, ...], torch.Tensor] = {}  # (trim) one tensor per set of live rows
        # Reuse (trim, cache on, default groups, no appended segments): the step forward's positions,
        # real and written slots, groups and attention mask depend only on its width, the cache columns
        # it takes, the live rows and each row's window end, cached length and cache boundary, all of
        # which the read (every step here) brings to the host; while they stay the same (the steps of
        # a block) the forward takes them from the previous step and gathers only the ids.
        # the default groups depend only on the position and the row's origin: one (N, S) table per decode
        self.static_groups = getattr(type(blocks), "attention_groups", None) is BlockSchedule.attention_groups
        self.reuse = trim and cached and model.attention != "full" and not self.segment_hooks and self.static_groups
        self.saved = SavedLayout()  # (reuse) the step forward's layout of the last step that built one
        # the facts of the step forward last run: only for a hook that lays out the step's window again
        # (window() without facts); every stage of the loop gets them as an argument
        self.last = StepFacts()
        n, self.length = state.canvas.shape
        self.window_width, self.block_length = blocks.window_width(), blocks.block_length
        self.full = model.attention == "full"
        self.prefilled = not cached
        self.eyes: dict[int, torch.Tensor] = {}
        self.aranges: dict[int, torch.Tensor] = {}
        self.cache_group: torch.Tensor | None = None
        self.overflow = torch.zeros((), dtype=torch.bool, device=state.device)  # a span wider than its forward
        self.overflow_rows = self.overflow.expand(n)  # a view: window() ORs into self.overflow in place
        self.empty = torch.zeros(0, dtype=torch.long, device=state.device)
        self.canvas_pos = torch.arange(self.length, device=state.device).expand(n, -1)  # (N, L)
        if cached:
            key = ("kv", n, self.length)
            store = shared(model) if mode != "eager" else {}
            state.cache = store.get(key) or model.new_cache(n, self.length)
            store[key] = state.cache
            state.cache_len = torch.zeros(n, dtype=torch.long, device=state.device)

    # -- the host read --------------------------------------------------------------------
    def read(self, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, checks: StepChecks) -> StepFacts | None:
        """The one host read: raise on a set device flag (:mod:`dlm_toolkit.step.flags`: the step checks,
        the hooks' flags, the engine's own); None when no row is live; else the step's
        :class:`~dlm_toolkit.step.facts.StepFacts` (the forward's width among them; the KV cache is
        prefilled before the first step). How: :mod:`dlm_toolkit.decoding.read`."""
        how = read_every_row if self.trim else read_reduced
        return how(self, live, lo, hi, checks, ENGINE_FLAGS)

    def rows_tensor(self, keep: tuple[int, ...]) -> torch.Tensor:
        """``keep`` as a long tensor on the decode's device, one per set of rows (a decode sees few)."""
        out = self.row_sets.get(keep)
        if out is None:
            out = self.row_sets[keep] = torch.tensor(keep, dtype=torch.long, device=self.state.device)
        return out

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

    # -- the forward primitive ----------------------------------------------------------------
    def eye(self, t: int) -> torch.Tensor:
        """(T, T) bool identity, one per width (every slot sees itself)."""
        eye = self.eyes.get(t)
        if eye is None:
            eye = self.eyes[t] = torch.eye(t, dtype=torch.bool, device=self.state.device)
        return eye

    def pattern(self, pos: torch.Tensor, real: torch.Tensor,
                group: torch.Tensor | None = None) -> torch.Tensor:
        """(N, T, T) bool attention among one segment's own positions: a real query sees the real keys
        the schedule's groups allow (every real key for full attention); a padding query sees only
        itself (no empty row, nothing that could leak into real positions). ``group``: the
        schedule's attention groups of ``pos`` when the caller has them."""
        if not self.full and group is None:
            group = self.blocks.attention_groups(self.state, self.state.all_rows, pos)
        one = Segment(pos, pos, real, None if self.full else group)
        return layout([one], self.eye(pos.shape[1]))[2]

    def groups(self, pos: torch.Tensor) -> torch.Tensor | None:
        """(N, T) attention groups of canvas positions ``pos`` (the block schedule's), ``None`` for
        full attention. With the default groups: looked up in the decode's one table
        (:meth:`cache_groups`; positions past the canvas take the last one's, which only padding
        slots hold)."""
        if self.full:
            return None
        if self.static_groups:
            return self.cache_groups().gather(1, pos.clamp(0, self.length - 1))
        return self.blocks.attention_groups(self.state, self.state.all_rows, pos)

    def cache_groups(self) -> torch.Tensor:
        """(N, S) attention groups of every canvas position, which the cached prefix is seen by. A
        schedule with the default groups (block of the position, from the row's origin) has the
        same table the whole decode: built once; any other schedule's groups may follow its moving
        blocks and are built for every forward."""
        if self.static_groups:
            if self.cache_group is None:
                self.cache_group = self.blocks.attention_groups(self.state, self.state.all_rows, self.canvas_pos)
            return self.cache_group
        return self.blocks.attention_groups(self.state, self.state.all_rows, self.canvas_pos)

    def run(self, segments: list[Segment], nfe_rows: torch.Tensor | None = None,
            facts: StepFacts | None = None, saved: tuple[torch.Tensor, ...] = ()) -> list[torch.Tensor]:
        """THE forward of the engine: lay ``segments`` side by side (:func:`~dlm_toolkit.step.segments.layout`),
        add the KV-cache columns (cached keys each segment sees, the slots it writes), run the
        model through the runner of that width, time it, count it, and return each segment's
        logits ``(N, T_i, V)``.

        Counters: one ``forward_calls``; every real slot of every segment in ``forward_tokens`` of
        its row; with ``nfe_rows`` ((N,) bool) the forward is also one NFE of those rows (``nfe``
        and the per-block forward count ``block_step`` that the per-block bound checks). ``facts``
        (the step forward of an eager decode that reads every step, ``self.trim``): only the rows
        live in the read and the cache columns some row filled. ``saved``: the step forward's mask
        with the cache columns, writes and tokens per row, of a step with the same layout key."""
        s = self.state
        trim = facts is not None and self.trim
        if saved:  # precondition: the same layout key as the step that built it (window()): only the ids are new
            ids, pos = segments[0].ids, segments[0].pos
            with_cache, writes, tokens = saved
            args: tuple[torch.Tensor, ...] = (ids, pos, with_cache, writes)
        else:
            args, tokens = self.arguments(segments, facts.needed if trim and facts is not None else None)
            if trim and self.reuse and self.saved.key is not None and self.saved.run is None:
                self.saved.run = (args[2], args[3], tokens)
        run = self.runner(args[1].shape[1])
        t0 = perf_counter()
        keep = facts.live if trim and facts is not None else None
        if keep is not None and len(keep) < s.batch_size:  # precondition: rows left out are not live (the read)
            logits = self.forward_rows(self.rows_tensor(keep), args)
        else:
            logits = run(*args)
        s.model_time += perf_counter() - t0
        s.forward_calls += 1
        s.counts_columns(FORWARD_TOKENS, None).add_(tokens)  # a view made once per decode
        if nfe_rows is not None:
            s.counts[:, 0] += nfe_rows.long()  # nfe
            s.block_step += nfe_rows.long()
        if len(segments) == 1:
            return [logits]
        return list(logits.split([seg.width for seg in segments], 1))

    def arguments(self, segments: list[Segment], needed: int | None = None
                  ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """The model's arguments for a forward over ``segments`` (ids, positions, the attention mask
        with the KV-cache columns first, the cache writes; without the cache the first three) and
        the real slots of each row (``forward_tokens``). ``needed`` (trim): the cache columns some
        live row has filled (the read's), instead of all."""
        s = self.state
        eye = self.eye(sum(seg.width for seg in segments))
        real = torch.cat([seg.real for seg in segments], 1) if len(segments) > 1 else segments[0].real
        if self.cached:
            assert s.cache_len is not None
            cols = self.length if needed is None else needed  # precondition: no live row's cache is longer
            if plain_window(segments):  # the step's own window: its mask in one comparison of groups
                one = segments[0]
                not_cached = self.canvas_pos[:, :cols] >= s.cache_len[:, None]
                mask = window_with_cache(one, not_cached, self.cache_groups()[:, :cols], eye)
                return (one.ids, one.pos, mask, cache_writes(segments)), real.sum(1)
            ids, pos, allowed = layout(segments, eye)
            in_cache = self.canvas_pos[:, :cols] < s.cache_len[:, None]
            seen = cache_seen(segments, in_cache, self.cache_groups()[:, :cols])
            args: tuple[torch.Tensor, ...] = (ids, pos, torch.cat([seen, allowed], -1), cache_writes(segments))
        else:
            args = layout(segments, eye)
        return args, real.sum(1)

    def extra_forward(self, segments: Sequence[Segment], rows: torch.Tensor) -> list[torch.Tensor]:
        """A forward of its own for a hook (e.g. a verification): ``segments`` as :meth:`run` lays
        them out (the first is the primary one), counted as one NFE of each of ``rows`` ((N,) bool)
        and one ``forward_calls``; each segment's logits. Shapes: the captured runner is per width,
        so a captured decode should keep to the widths its steps use (``window_width()`` plus a
        block with the cache; the canvas plus a block without) or accept one capture more."""
        who, n = "extra_forward", self.state.batch_size
        segments = [check(seg, n, who) for seg in segments]
        if not segments:
            raise StrategyError(f"{who}: needs at least one segment")
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.bool or tuple(rows.shape) != (n,):
            got = (f"{rows.dtype} tensor of shape {tuple(rows.shape)}" if isinstance(rows, torch.Tensor)
                   else type(rows).__name__)
            raise StrategyError(f"{who}: rows must be a bool tensor of shape ({n},), got {got}")
        return self.run(segments, nfe_rows=rows)

    def segment_logits(self, hook: Any) -> list[torch.Tensor]:
        """The logits ``(N, T_i, V)`` of the segments ``hook``'s ``step_segments`` added to the last step
        forward (empty when it added none)."""
        return self.added.get(id(hook), [])

    # -- one step's forward -----------------------------------------------------------------
    def window(self, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, facts: StepFacts | None = None,
               hit: bool = False) -> tuple[Segment, torch.Tensor, torch.Tensor | None]:
        """The step's primary segment: the span of every row's window, as wide as the read's width;
        ``(segment, first, boundary)``: ``first`` (N, 1) the span's start (negative: left padding),
        ``boundary`` (N,) the schedule's cache boundary (``None`` without the cache). ``hit``: the
        saved layout has this step's layout key. A hook calls it without ``facts``: the window of
        the step forward last run, laid out as on a step between reads (and saved under no key)."""
        s, blocks = self.state, self.blocks
        if facts is None:
            facts, hit = replace(self.last, read=False, layout_key=None), False
        if hit:  # precondition: the same layout key (__init__): positions, real and written slots, groups
            pos, real, group, write, first = self.saved.window
            boundary = blocks.cache_boundary(s, s.all_rows, lo, hi)
            return Segment(s.canvas.gather(1, pos), pos, real, group, write=write), first, boundary
        fresh = facts.read
        width = facts.width if fresh or not self.cached else max(facts.width, self.window_width + self.block_length)
        if self.cached:  # the span ends at the window's end; before the cached length is padding
            assert s.cache_len is not None
            pos = hi[:, None] - width + self.arange(width)
            real = live[:, None] & (pos >= s.cache_len[:, None])
            if not fresh:  # right after a read the width holds the widest live span (read): no overflow
                self.overflow |= (live & (hi - s.cache_len > width)).any()
        elif self.full:  # the row's whole canvas, left-padded so its last query is real
            pos = s.length[:, None] - self.length + self.canvas_pos
            real = live[:, None] & (pos >= 0)
        else:  # the whole canvas; positions from the window's end on are padding
            pos = self.canvas_pos
            if self.trim:  # precondition: no live row's window ends past ``needed`` (the read's max hi)
                width = max(1, min(self.length, -(-facts.needed // self.block_length) * self.block_length))
                pos = pos[:, :width]
            real = live[:, None] & (pos < hi[:, None])
        first = pos[:, :1]  # the span's start (may be negative: left padding)
        pos = pos.clamp(0, self.length - 1)
        write = boundary = None
        if self.cached:
            boundary = blocks.cache_boundary(s, s.all_rows, lo, hi)
            write = real & (pos < boundary[:, None])
        # pos is clamped onto the canvas already: the default groups are a plain lookup
        group = None if self.full else self.cache_groups().gather(1, pos) if self.static_groups else self.groups(pos)
        own = None
        if not self.cached and not self.full and self.static_groups:
            own = self.prefix_pattern(pos, real, hi, group)
        if self.reuse:
            assert write is not None and group is not None
            self.saved = SavedLayout(facts.layout_key, (pos, real, group, write, first))
        return Segment(s.canvas.gather(1, pos), pos, real, group, write=write, own=own), first, boundary

    def prefix_pattern(self, pos: torch.Tensor, real: torch.Tensor, hi: torch.Tensor,
                       group: torch.Tensor | None) -> torch.Tensor:
        """(N, T, T) the window's own attention without the cache, for the default groups, in one
        comparison: ``pos`` is the canvas from 0 and ``real`` its positions before ``hi`` (live rows),
        and a group ends at ``origin + (group + 1) * block_length`` (groups rise with the position;
        -1 before the origin), so a real query sees exactly the keys before the nearer of its
        group's end and ``hi``; a padding query none (the layout adds every slot itself)."""
        assert group is not None
        end = self.state.origin[:, None] + (group + 1) * self.block_length
        limit = torch.where(real, torch.minimum(end, hi[:, None]), 0)
        return pos[:, None, :] < limit[:, :, None]

    def arange(self, n: int) -> torch.Tensor:
        """``arange(n)`` on the decode's device, one per length."""
        out = self.aranges.get(n)
        if out is None:
            out = self.aranges[n] = torch.arange(n, device=self.state.device)
        return out

    def forward(self, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, facts: StepFacts) -> torch.Tensor:
        """Logits ``(N, W, V)`` of the window ``hi - W + [0, W)`` of every row (rows not live and
        positions before ``lo`` are padding), laid out from this step's ``facts``. The hooks'
        ``step_segments`` append their segments to this forward; their logits are :meth:`segment_logits`."""
        s = self.state
        # the layout of the last step that built one is this step's when the layout keys are equal
        hit = self.reuse and facts.layout_key is not None and facts.layout_key == self.saved.key
        self.last = facts
        window, first, boundary = self.window(live, lo, hi, facts, hit)
        segments, owners = [window], []
        for hook, add in self.segment_hooks:
            who = hook_label(hook)
            added = [check(seg, s.batch_size, f"{who} (step_segments)") for seg in add(self, s, live, window)]
            segments += added
            owners.append((hook, len(added)))
        logits = self.run(segments, facts=facts, saved=(self.saved.run or ()) if hit else ())
        if boundary is not None and (facts.cache_moves or not self.reuse):  # (reuse) the read saw whether it moves
            assert s.cache_len is not None
            s.cache_len = torch.where(live, boundary, s.cache_len)
        self.added, at = {}, 1
        for hook, count in owners:
            self.added[id(hook)] = logits[at:at + count]
            at += count
        out, width, w = logits[0], window.width, self.window_width
        if self.cached:  # the span ends at the window's end: its last W slots (all of them: no slice op)
            out = out[:, width - w:] if width > w else out
            # captured: a contiguous copy (a graph's output buffer; one layout for the rules)
            return out if self.mode == "eager" else out.clone()
        index = (hi[:, None] - w + self.arange(w) - first).clamp(0, width - 1)
        return out.gather(1, index[:, :, None].expand(-1, -1, out.shape[-1]))

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


def _schedule(hit: FlagHit) -> str:
    return f"block schedule '{hit.source.blocks.name}'"


# the engine's own schedule errors: a window start back in the KV cache (or a cache boundary outside
# [cached length, window start]), a window wider than window_width(), a window more than one block
# past the cache between reads (seen by the forward: self.overflow)
ENGINE_FLAGS = (BAD_CACHE, TOO_WIDE, OVERFLOW) = (
    DeviceFlag("window_in_cache", lambda hit: (
        f"{_schedule(hit)} moved a window start back into the KV cache, or declared a cache boundary outside "
        f"[cached length, window start] (batch row {hit.row})")),
    DeviceFlag("window_too_wide", lambda hit: (
        f"{_schedule(hit)} returned a window wider than its window_width() ({hit.source.window_width} positions) "
        f"(batch row {hit.row})")),
    DeviceFlag("window_past_cache", lambda hit: (
        f"{_schedule(hit)} moved its window more than one block past the KV cache between host reads; decode with "
        "check_every=1")),
)
declare("the step engine", ENGINE_FLAGS, after_hooks=True)
