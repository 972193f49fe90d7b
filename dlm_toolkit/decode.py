"""The decode loop. Read :func:`decode` first: everything else is plumbing for it.

One iteration = one model forward (one NFE for every live row in it): ``blocks.prepare`` says
which rows are live (finishing blocks that need no forward), ``blocks.window`` which positions'
logits are used, the model runs with the attention pattern and KV-cache boundary the schedule
declares, the policy's rules choose what to commit / edit / remask, the canvas is written, and
``blocks.finish_step`` ends converged blocks. Strategies keep no state; the :class:`DecodeState`
holds it all.

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
broke the window/cache rules, whether an insert/delete edit was flagged (:mod:`dlm_toolkit.indel`),
and the contract checks of the steps since the last read (a broken contract raises there, before
anything is returned). Nothing else in the loop reads the device: not the rules, the checks, the
canvas writes, the insert/delete shifts, the block ends or the random draws (counter-based,
:mod:`dlm_toolkit.rng`). The first read of a decode also gives the prefill's width. Recording a
trajectory reads every step.

Why every row forwards every step (behind ``live``) rather than the batch being compacted to the
rows still decoding: compaction needs the host to know which rows those are (a read) and gives
each step a different batch shape (a capture per count). The price is compute spent on finished
rows until the slowest row of the batch is done.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Literal, Mapping, Sequence

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.policy_config import PolicyConfig
from dlm_toolkit.models.base import DiffusionLM, model_device
from dlm_toolkit.policy import DecodingPolicy, StepChecks, StrategyError
from dlm_toolkit.rule_capture import RuleRunners
from dlm_toolkit.state import COUNTERS, DecodeResult, DecodeState, row_seeds, validate_prompts
from dlm_toolkit.strategy import StepContext
from dlm_toolkit.trajectory import Trajectory
from dlm_toolkit.indel import indel_forwards, indel_of, indel_step, raise_indel_error
from dlm_toolkit import shadow as shadow_block
from dlm_toolkit.verify import check_model, forward_limit, verifier_of, verify_step


FORWARD_TOKENS = COUNTERS.index("forward_tokens")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a captured step is built for; larger batches are split
CaptureMode = Literal["eager", "compile", "cuda_graphs"]
COMPILE_BACKEND = "inductor"  # torch.compile backend of capture="compile" (tests use "aot_eager": same graph, no codegen)


def decode(
    model: DiffusionLM,
    prompts: Sequence[Sequence[int]],
    policy: DecodingPolicy | PolicyConfig | str | Mapping[str, Any] | None = None,
    gen_length: int = 128,
    *,
    kv_cache: bool = True,
    seed: int | Sequence[int] | None = 0,
    record: bool = False,
    allow_past_context: bool = False,
    cuda_graphs: bool | None = None,
    check_every: int = 1,
    capture: CaptureMode | None = None,
) -> DecodeResult:
    """Decode a batch of prompts with a policy.

    Args:
        model: any :class:`~dlm_toolkit.models.base.DiffusionLM`, on any device.
        prompts: token-id lists (lengths may differ; rows decode independently).
        policy: a :class:`DecodingPolicy`, a config, a preset name or a dict (default ``llada2.1-q``).
        gen_length: generated positions per prompt (the output is cut after the first EOS).
        kv_cache: keep an exact prefix KV cache of finished blocks (block-causal models only);
            gives the same tokens and NFE as recomputing the prefix every forward.
        seed: an int (row r draws with the key ``row_seed(seed, r)``) or one seed per prompt (used
            as is). Draws are keyed by (row seed, row step, position), so sampling and random rules
            give a row the same tokens whatever batch it is decoded in.
        record: attach a :class:`~dlm_toolkit.trajectory.Trajectory` of every step.
        allow_past_context: decode even where the canvas (prompt + generation, whole blocks)
            runs past the model's ``max_position_embeddings``; refused by default, since the
            model has never seen those positions.
        cuda_graphs: capture the model forward once per (batch bucket, width, canvas), and each
            rule of the policy once per layout (:mod:`dlm_toolkit.rule_capture`), in CUDA graphs
            and replay them; ``None``: on when the model is on CUDA. A rule that cannot be
            captured runs eagerly after one warning naming it (same tokens). Rows are padded to a
            bucket of :data:`BUCKETS` (a larger batch is decoded in slices of the largest bucket)
            and the canvas to a power of two, so that decodes of many prompts share captures.
        check_every: steps between host reads (see the module docstring). The default 1 keeps
            ``forward_calls`` as low as possible; larger values run up to that many forwards
            without waiting for the host (tokens and NFE stay the same: rows that finished in
            between ride along with nothing written).
        capture: engineering knob overriding ``cuda_graphs``: ``"compile"`` runs each forward
            through ``torch.compile(fullgraph=True, dynamic=False)`` (any device; the tests use
            it on the CPU), ``"eager"`` plain calls.
    """
    policy = policy if isinstance(policy, DecodingPolicy) else DecodingPolicy(policy)
    blocks = policy.blocks
    device = model_device(model)
    mode = capture_mode(cuda_graphs, capture, device)
    if isinstance(check_every, bool) or not isinstance(check_every, int) or not 1 <= check_every <= 1024:
        raise ConfigError(f"check_every: must be an integer in [1, 1024] (got {check_every!r})")
    validate_prompts(prompts, gen_length, model.mask_token_id, model.vocab_size)
    check_model(policy, model.attention)
    shadow_block.check_model(policy, model.attention)
    if not allow_past_context:
        origin, _, num = blocks.layout(torch.tensor([len(p) for p in prompts], device="cpu"), gen_length)
        check_context(model, int((origin + num * blocks.block_length).max()), blocks.block_length)
    seeds = row_seeds(seed, len(prompts))
    cached = kv_cache and model.supports_kv_cache and model.attention == "block_causal"
    if mode == "eager":  # no capture to reuse: no bucket padding, no slicing
        return decode_rows(model, prompts, seeds, policy, gen_length, cached, record, mode, check_every, len(prompts))
    step = BUCKETS[-1]
    parts = [decode_rows(model, prompts[i:i + step], seeds[i:i + step], policy, gen_length, cached, record, mode,
                         check_every, bucket(len(prompts[i:i + step])))
             for i in range(0, len(prompts), step)]
    return DecodeResult.concat(parts, model.mask_token_id)


def decode_rows(model: DiffusionLM, prompts: Sequence[Sequence[int]], seeds: list[int], policy: DecodingPolicy,
                gen_length: int, cached: bool, record: bool, mode: CaptureMode, check_every: int,
                rows: int) -> DecodeResult:
    """Decode ``prompts`` as a batch of ``rows`` rows (rows past the prompts pad a bucket and are
    done from the start)."""
    blocks = policy.blocks
    n = len(prompts)
    padded = list(prompts) + [prompts[0]] * (rows - n)
    state = DecodeState.start(padded, gen_length, blocks, model.mask_token_id, model.eos_token_id, model.vocab_size,
                              list(seeds) + [0] * (rows - n), model_device(model), round_width=mode != "eager")
    state.done[n:] = True
    engine = StepEngine(model, blocks, state, cached, mode, trim=mode == "eager" and check_every == 1,
                        shadow=shadow_block.shadow_rule(policy) is not None)
    rules_step = policy.step if mode == "eager" else RuleRunners(policy, mode, COMPILE_BACKEND, shared(model)).step
    verifier = verifier_of(policy)  # an m2t rule that asks for a verification forward (dlm_toolkit.verify)
    indel = indel_of(policy)  # a t2t rule that also inserts/deletes positions (dlm_toolkit.indel)
    trajectory = Trajectory(n_rows=n) if record else None
    checks = StepChecks(policy, forward_limit(policy) + indel_forwards(policy))
    start = perf_counter()
    with torch.inference_mode():
        since_read = check_every
        while True:
            live = blocks.prepare(state)
            lo, hi = blocks.window(state, state.all_rows)
            if since_read >= check_every:  # the one host read (module docstring)
                if not engine.read(live, lo, hi, checks):
                    break
                since_read = 0
            since_read += 1
            logits = engine.forward(live, lo, hi)  # (N, W, V)
            ctx = step_context(policy, state, live, lo, hi, logits)
            if engine.shadow_logits is not None:  # a rule reads the shadow block (dlm_toolkit.shadow)
                ctx.shadow_confidence = shadow_block.shadow_confidence(ctx, engine.shadow_logits, state)
            rules_step(ctx, state.memory)
            if verifier is not None:
                verify_step(engine, verifier, ctx, policy.sampling.temperature)
            write(state, ctx)
            if indel is not None:
                indel_step(state, ctx, indel)
            blocks.finish_step(state, ctx)
            checks.add(ctx, state)
            if trajectory is not None:
                trajectory.add(ctx, state)
    result = state.result(perf_counter() - start, n)
    result.trajectory = trajectory
    return result


def bucket(n: int) -> int:
    """The smallest batch bucket holding ``n`` rows (``n`` at most the largest bucket)."""
    return next(b for b in BUCKETS if b >= n)


def capture_mode(cuda_graphs: bool | None, capture: CaptureMode | None, device: torch.device) -> CaptureMode:
    """How forwards run: ``capture`` if given, else CUDA graphs when asked for (or, by default,
    when the model is on CUDA), else eagerly."""
    if capture is not None:
        if capture not in ("eager", "compile", "cuda_graphs"):
            raise ConfigError(f"capture: must be 'eager', 'compile' or 'cuda_graphs' (got {capture!r})")
        cuda_graphs = capture == "cuda_graphs"
        if not cuda_graphs:
            return capture
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ConfigError(f"cuda_graphs: must be true, false or null (got {cuda_graphs!r})")
    if cuda_graphs and device.type != "cuda":
        raise ConfigError(f"cuda_graphs needs a CUDA device; the model is on {device.type}")
    return "cuda_graphs" if (device.type == "cuda" if cuda_graphs is None else cuda_graphs) else "eager"


def check_context(model: DiffusionLM, canvas: int, block_length: int, what: str = "the decode") -> None:
    """Refuse a canvas of ``canvas`` positions past the model's ``max_position_embeddings`` (models
    without one have no limit)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and canvas > limit:
        raise ConfigError(
            f"{what} needs a canvas of {canvas} positions (prompt + gen_length, whole blocks of {block_length}) but "
            f"the model's context is {limit} (max_position_embeddings); pass allow_past_context=True "
            "(--allow-past-context) to decode on positions the model never saw"
        )


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
                 trim: bool = False, shadow: bool = False):
        self.model, self.blocks, self.state, self.cached, self.mode = model, blocks, state, cached, mode
        self.shadow = shadow  # append a shadow block to every step's forward (dlm_toolkit.shadow)
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
        if self.shadow:  # WINO's shadow block after the window (dlm_toolkit.shadow)
            assert group is not None
            ids, pos, allowed, seen, write, shadow_real = shadow_block.add_shadow(
                s, blocks, live, pos, real, group, ids, allowed, seen, write, self.canvas_pos, in_cache, cache_group)
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
        a :class:`~dlm_toolkit.capture.StepRunner` kept per (mode, bucket, width, canvas)."""
        s, model = self.state, self.model
        if self.mode == "eager":
            if self.cached:
                return lambda ids, pos, allowed, write: model.forward_window(
                    ids, pos, allowed, cache=s.cache, cache_rows=s.all_rows, cache_write=write)
            return model.forward_window
        from dlm_toolkit.capture import StepRunner

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
                                    self.mode, backend=COMPILE_BACKEND)
        return store[key]


def raise_bad_bounds(state: DecodeState, live: torch.Tensor, schedule: str) -> None:
    """The error for a dynamic block proposed outside ``[prompt_len, canvas length)`` (host reads:
    only on the way to raising)."""
    assert state.bounds_error is not None and state.block_lo is not None and state.block_hi is not None
    r = int((live & state.bounds_error).nonzero()[0, 0])
    lo, hi, p, n = (int(t[r]) for t in (state.block_lo, state.block_hi, state.prompt_len, state.length))
    where = f"overlaps the prompt (positions [0, {p}))" if lo < p else f"leaves the canvas [0, {n})"
    raise StrategyError(f"block schedule '{schedule}' proposed the active block [{lo}, {hi}) for batch row {r}, "
                        f"which {where}: a dynamic block must lie in [{p}, {n}) and hold at least one position")


def step_context(policy: DecodingPolicy, state: DecodeState, live: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                 logits: torch.Tensor) -> StepContext:
    """The :class:`StepContext` of every row for the window ``hi - W + [0, W)`` (real from ``lo``, in
    live rows)."""
    rows = state.all_rows
    width = logits.shape[1]
    positions = hi[:, None] - width + torch.arange(width, device=state.device)  # (N, W)
    idx = positions.clamp(0, state.canvas.shape[1] - 1)
    block_lo, block_hi = state.block_bounds(rows)
    ctx = StepContext.build(
        rows=rows,
        positions=positions,
        valid=(positions >= lo[:, None]) & live[:, None],
        tokens=state.canvas.gather(1, idx),
        prompt_len=state.prompt_len,
        block_lo=block_lo,
        block_hi=block_hi,
        logits=logits,
        sampling=policy.sampling,
        written_step=state.written_step.gather(1, idx),
        written_conf=state.written_conf.gather(1, idx),
        step=state.nfe.clone(),  # clones: the engine updates these in place after the rules ran
        block=state.block.clone(),
        block_step=state.block_step.clone(),
        block_masked_start=state.block_masked_start.clone(),
        seeds=state.seeds,
        memory=state.memory,
        mask_token_id=state.mask_token_id,
        eos_token_id=state.eos_token_id,
        batch_rows=state.batch_size,
        live=live,
    )
    ctx.editable = ctx.editable & policy.blocks.edit_region(state, ctx)
    return ctx


def window_slots(ctx: StepContext, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(at_pos, same)``: the canvas position each window slot writes (padding clamps onto real
    positions) and the window slot holding that position, whose value every write there carries."""
    at_pos = ctx.positions.clamp(0, length - 1)
    return at_pos, (at_pos - ctx.positions[:, :1]).clamp(0, ctx.positions.shape[1] - 1)


def write(state: DecodeState, ctx: StepContext) -> None:
    """Write commits, edits and remasks of one step at once, and count them (live rows only).

    The whole window is written back (unselected positions with their old values), so no host
    sync is needed to find the selected ones. Padding positions clamp onto canvas positions that
    may also be in the window; each write there carries the value that position ends with, so
    repeated indices always write the same value.
    """
    assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
    rows, live = ctx.rows, ctx.live
    at_pos, same = window_slots(ctx, state.canvas.shape[1])
    at = (rows[:, None], at_pos)
    wrote = ctx.commit | ctx.edit
    state.canvas[at] = torch.where(ctx.remask, state.mask_token_id, torch.where(wrote, ctx.sampled, ctx.tokens)).gather(1, same)
    step = state.nfe[rows, None]
    state.written_step[at] = torch.where(ctx.remask, -1, torch.where(wrote, step, ctx.written_step)).gather(1, same)
    state.written_conf[at] = torch.where(ctx.remask, 0.0, torch.where(wrote, ctx.confidence, ctx.written_conf)).gather(1, same)
    n_commit = ctx.commit.sum(1)
    step_counts = torch.stack(  # one row per context row, columns as COUNTERS
        [
            torch.ones_like(n_commit),
            n_commit,
            ctx.edit.sum(1),
            ctx.remask.sum(1),
            (n_commit >= 2).long(),
            ctx.post.long(),
            (ctx.post & ctx.edit.any(1)).long(),
            (ctx.block_step == 0).long(),
            torch.zeros_like(n_commit),  # forward_tokens: counted by the forwards
            torch.zeros_like(n_commit),  # inserts, deletes: counted by dlm_toolkit.indel
            torch.zeros_like(n_commit),
        ],
        dim=1,
    ) * live[:, None]
    state.counts.index_add_(0, rows, step_counts)
    state.block_masked[rows] -= step_counts[:, 1] - step_counts[:, 3]  # commits and remasks stay in the block
    state.block_step[rows] += live.long()
