"""The decode loop. Read :func:`decode` first: everything else is plumbing for it.

One iteration = one model forward (one NFE for every row in it):
``blocks.prepare`` picks the rows that need a forward (finishing blocks that need none),
``blocks.window`` says which positions' logits are used, the model runs with the attention
pattern and KV-cache boundary the schedule declares, the policy's rules choose what to commit /
edit / remask, the canvas is written, and ``blocks.finish_step`` ends converged blocks.
Strategies keep no state; the :class:`DecodeState` holds it all.

Device: the model's device is the decode's device; every tensor is made there. Host syncs
(the host waiting for the device to read a value) per step, each one needed by the algorithm:

1. which rows forward now, together with the previous step's contract checks (one read);
2. the window's shape (width, padded span, cached prefix length) and per-row real widths: the
   forward's input shapes and the number of random draws per row depend on them.

Everything else (rule contracts, NFE bounds, non-finite logits, canvas writes, block ends) stays
on the device; a broken contract is raised at the next step's read, before anything is returned.
The model may sync internally (e.g. the cache write); recording a trajectory reads every step.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any, Mapping, Sequence

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.policy_config import PolicyConfig
from dlm_toolkit.models.base import DiffusionLM, model_device
from dlm_toolkit.policy import DecodingPolicy, StepChecks, StrategyError
from dlm_toolkit.state import COUNTERS, DecodeResult, DecodeState, validate_prompts
from dlm_toolkit.strategy import StepContext
from dlm_toolkit.trajectory import Trajectory


FORWARD_TOKENS = COUNTERS.index("forward_tokens")


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
) -> DecodeResult:
    """Decode a batch of prompts with a policy.

    Args:
        model: any :class:`~dlm_toolkit.models.base.DiffusionLM`, on any device.
        prompts: token-id lists (lengths may differ; rows decode independently).
        policy: a :class:`DecodingPolicy`, a config, a preset name or a dict (default ``llada2.1-q``).
        gen_length: generated positions per prompt (the output is cut after the first EOS).
        kv_cache: keep an exact prefix KV cache of finished blocks (block-causal models only);
            gives the same tokens and NFE as recomputing the prefix every forward.
        seed: an int (row r draws from a stream seeded by ``row_seed(seed, r)``) or one seed per
            prompt (used as is). Each row has its own stream, so sampling and random rules give a
            row the same tokens whatever batch it is decoded in.
        record: attach a :class:`~dlm_toolkit.trajectory.Trajectory` of every step.
        allow_past_context: decode even where the canvas (prompt + generation, whole blocks)
            runs past the model's ``max_position_embeddings``; refused by default, since the
            model has never seen those positions.
    """
    policy = policy if isinstance(policy, DecodingPolicy) else DecodingPolicy(policy)
    blocks = policy.blocks
    device = model_device(model)
    validate_prompts(prompts, gen_length, model.mask_token_id, model.vocab_size)
    if not allow_past_context:
        origin, _, num = blocks.layout(torch.tensor([len(p) for p in prompts], device="cpu"), gen_length)
        check_context(model, int((origin + num * blocks.block_length).max()), blocks.block_length)
    state = DecodeState.start(
        prompts, gen_length, blocks, model.mask_token_id, model.eos_token_id, model.vocab_size, seed, device
    )
    if kv_cache and model.supports_kv_cache and model.attention == "block_causal":
        state.cache = model.new_cache(state.batch_size, state.canvas.shape[1])
        state.cache_len = torch.zeros(state.batch_size, dtype=torch.long, device=device)
    trajectory = Trajectory() if record else None
    checks = StepChecks(policy, blocks.max_forwards_per_block())
    start = perf_counter()
    with torch.inference_mode():
        while (ready := ready_rows(blocks.prepare(state), checks)) is not None:
            rows, row_ids = ready
            lo, hi = blocks.window(state, rows)
            logits, start_pos, n_valid = forward_window(model, blocks, state, rows, lo, hi)  # (R, W, V)
            ctx = step_context(policy, state, rows, row_ids, start_pos, lo, logits, n_valid)
            policy.step(ctx, state.memory)
            write(state, ctx)
            blocks.finish_step(state, ctx)
            checks.add(ctx, state)
            if trajectory is not None:
                trajectory.add(ctx, state)
    result = state.result(perf_counter() - start)
    result.trajectory = trajectory
    return result


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


def ready_rows(ready: torch.Tensor, checks: StepChecks) -> tuple[torch.Tensor, list[int]] | None:
    """Host sync 1: the rows to forward, as a tensor and as host ints (None when every row is
    done), read together with the previous step's contract checks, which raise here if one failed."""
    flags = checks.pending(ready.device)
    host = torch.cat([ready.long(), flags.long()]).tolist()
    n = ready.numel()
    checks.raise_if_failed(host[n:])
    rows = [r for r, v in enumerate(host[:n]) if v]
    return (torch.tensor(rows, dtype=torch.long, device=ready.device), rows) if rows else None


def forward_window(model: DiffusionLM, blocks: Any, state: DecodeState, rows: torch.Tensor, lo: torch.Tensor,
                   hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One forward for ``rows``: logits ``(R, W, V)`` for the window ``[start, hi)`` (real from ``lo``),
    the window start ``start`` (R,) and the real width ``hi - lo`` of each row (host ints).

    Each row forwards its own query span, left-padded so all spans end together: block-causal
    with cache ``[cache_len, hi)`` (finished blocks not yet cached ride along and are written to
    the cache), block-causal without cache ``[0, hi)``, full attention the whole canvas. Who
    attends to whom is the schedule's ``attention_groups``; what enters the cache, its
    ``cache_boundary``.
    """
    device = state.device
    cached = state.cache is not None
    full = model.attention == "full"
    if full:
        q_start, q_end = torch.zeros_like(lo), state.length[rows]
    else:
        q_start, q_end = (state.cache_len[rows] if cached else torch.zeros_like(lo)), hi
    boundary = blocks.cache_boundary(state, rows, lo, hi) if cached else lo
    cache_len = state.cache_len[rows] if cached else torch.zeros_like(lo)
    # host sync 2: every shape of this forward, and whether the schedule broke the cache rules
    widths = hi - lo
    host = torch.cat([
        widths, torch.stack([(q_end - q_start).max(), cache_len.max(),
                             ((lo < q_start) | (boundary < cache_len) | (boundary > lo)).any().long()]),
    ]).tolist()
    n_valid, (span, n_cached, bad_cache) = host[: rows.numel()], host[rows.numel():]
    if bad_cache:
        raise StrategyError(
            f"block schedule '{blocks.name}' moved a window start back into the KV cache, or declared a cache "
            "boundary outside [cached length, window start]"
        )
    width = max(n_valid)
    pos = q_end[:, None] - span + torch.arange(span, device=device)  # (R, T) absolute, left-padded
    real = pos >= q_start[:, None]
    ids = state.canvas[rows[:, None], pos.clamp(min=0)]  # (R, T)
    if full:
        allowed = real[:, None, :].expand(-1, span, -1)
    else:
        group = blocks.attention_groups(state, rows, pos)  # (R, T)
        allowed = real[:, None, :] & (group[:, None, :] <= group[:, :, None])  # (R, T, T): query, key
    eye = torch.eye(span, dtype=torch.bool, device=device)
    allowed = allowed | eye  # padding queries see themselves: no NaN
    kwargs: dict[str, Any] = {}
    if cached:
        cache_pos = torch.arange(n_cached, device=device).expand(rows.numel(), -1)  # (R, S)
        cache_group = blocks.attention_groups(state, rows, cache_pos)
        in_cache = cache_pos < cache_len[:, None]
        allowed_cache = in_cache[:, None, :] & (cache_group[:, None, :] <= group[:, :, None])  # (R, T, S)
        allowed = torch.cat([allowed_cache, allowed], dim=-1)
        kwargs = dict(cache=state.cache, cache_rows=rows, cache_write=real & (pos < boundary[:, None]))
    t0 = perf_counter()
    logits = model.forward_window(ids, pos.clamp(min=0), allowed, **kwargs)  # (R, T, V)
    state.model_time += perf_counter() - t0
    state.forward_calls += 1
    state.counts[rows, FORWARD_TOKENS] += real.sum(1)
    if cached:
        state.cache_len[rows] = boundary
    start = hi - width  # (R,) window start, the same width for every row
    first = start - (q_end - span)  # window start inside the padded span
    index = (first[:, None] + torch.arange(width, device=device)).clamp(min=0)  # (R, W)
    return logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1])), start, n_valid


def step_context(policy: DecodingPolicy, state: DecodeState, rows: torch.Tensor, row_ids: Sequence[int],
                 start: torch.Tensor, lo: torch.Tensor, logits: torch.Tensor, n_valid: Sequence[int]) -> StepContext:
    """The :class:`StepContext` for the window ``start + [0, W)`` (real from ``lo``) of ``rows``."""
    width = logits.shape[1]
    positions = start[:, None] + torch.arange(width, device=state.device)  # (R, W)
    idx = (rows[:, None], positions.clamp(min=0))
    block_lo, block_hi = state.block_bounds(rows)
    ctx = StepContext.build(
        rows=rows,
        positions=positions,
        valid=positions >= lo[:, None],
        tokens=state.canvas[idx],
        prompt_len=state.prompt_len[rows],
        block_lo=block_lo,
        block_hi=block_hi,
        logits=logits,
        sampling=policy.sampling,
        written_step=state.written_step[idx],
        written_conf=state.written_conf[idx],
        step=state.nfe[rows],
        block=state.block[rows],
        block_step=state.block_step[rows],
        block_masked_start=state.block_masked_start[rows],
        generators=[state.generators[r] for r in row_ids],
        memory=state.memory,
        mask_token_id=state.mask_token_id,
        eos_token_id=state.eos_token_id,
        batch_rows=state.batch_size,
        n_valid=n_valid,
    )
    ctx.editable = ctx.editable & policy.blocks.edit_region(state, ctx)
    return ctx


def write(state: DecodeState, ctx: StepContext) -> None:
    """Write commits, edits and remasks of one step at once, and count them.

    The whole window is written back (unselected positions with their old values), so no host
    sync is needed to find the selected ones. Left padding may repeat position 0, but only where
    position 0 itself is outside the window, so every write there is its unchanged old value.
    """
    assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
    rows = ctx.rows
    wrote = ctx.commit | ctx.edit
    at = (rows[:, None], ctx.positions.clamp(min=0))
    state.canvas[at] = torch.where(ctx.remask, state.mask_token_id, torch.where(wrote, ctx.sampled, ctx.tokens))
    step = state.nfe[rows, None]
    state.written_step[at] = torch.where(ctx.remask, -1, torch.where(wrote, step, ctx.written_step))
    state.written_conf[at] = torch.where(ctx.remask, 0.0, torch.where(wrote, ctx.confidence, ctx.written_conf))
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
            torch.zeros_like(n_commit),
        ],
        dim=1,
    )
    state.counts.index_add_(0, rows, step_counts)
    state.block_masked[rows] -= n_commit - step_counts[:, 3]  # commits and remasks stay in the block
    state.block_step[rows] += 1
