"""The decode loop. Read :func:`decode` first: everything else is plumbing for it.

One iteration = one model forward (one NFE for every row in it):
``blocks.prepare`` picks the rows that need a forward (finishing blocks that need none),
``blocks.window`` says which positions' logits are used, the model runs, the policy's rules
choose what to commit / edit / remask, the canvas is written, and ``blocks.finish_step``
ends converged blocks. Strategies keep no state; the :class:`DecodeState` holds it all.
"""

from __future__ import annotations

from time import perf_counter
from typing import Any, Mapping, Sequence

import torch

from dlm_toolkit.config import PolicyConfig
from dlm_toolkit.models.base import DiffusionLM
from dlm_toolkit.policy import DecodingPolicy, StrategyError
from dlm_toolkit.state import COUNTERS, DecodeResult, DecodeState
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
    seed: int | None = 0,
    record: bool = False,
) -> DecodeResult:
    """Decode a batch of prompts with a policy.

    Args:
        model: any :class:`~dlm_toolkit.models.base.DiffusionLM`.
        prompts: token-id lists (lengths may differ; rows decode independently).
        policy: a :class:`DecodingPolicy`, a config, a preset name or a dict (default ``llada2.1-q``).
        gen_length: generated positions per prompt (the output is cut after the first EOS).
        kv_cache: keep an exact prefix KV cache of finished blocks (block-causal models only);
            gives the same tokens and NFE as recomputing the prefix every forward.
        seed: seed of the generator used by sampling and random rules.
        record: attach a :class:`~dlm_toolkit.trajectory.Trajectory` of every step.
    """
    policy = policy if isinstance(policy, DecodingPolicy) else DecodingPolicy(policy)
    blocks = policy.blocks
    state = DecodeState.start(
        prompts, gen_length, blocks, model.mask_token_id, model.eos_token_id, model.vocab_size, seed
    )
    if kv_cache and model.supports_kv_cache and model.attention == "block_causal":
        state.cache = model.new_cache(state.batch_size, state.canvas.shape[1])
        state.cache_len = torch.zeros(state.batch_size, dtype=torch.long)
    trajectory = Trajectory() if record else None
    limit = blocks.max_forwards_per_block()
    start = perf_counter()
    with torch.inference_mode():
        while (rows := blocks.prepare(state)).numel():
            lo, hi = blocks.window(state, rows)
            logits = forward_window(model, state, rows, lo, hi)  # (R, W, V)
            ctx = step_context(policy, state, rows, hi - logits.shape[1], lo, logits)
            policy.step(ctx, state.memory)
            write(state, ctx)
            blocks.finish_step(state, ctx)
            if trajectory is not None:
                trajectory.add(ctx, state)
            if (state.block_step[rows] > limit).any():
                raise StrategyError(f"block schedule '{blocks.name}' exceeded {limit} forwards in one block")
    result = state.result(perf_counter() - start)
    result.trajectory = trajectory
    return result


def forward_window(model: DiffusionLM, state: DecodeState, rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """One forward for ``rows``; returns logits ``(R, W, V)`` for the window ``[hi - W, hi)``.

    Each row forwards its own query span, left-padded so all spans end together:
    block-causal with cache ``[cache_len, hi)`` (finished blocks not yet cached ride along
    and are written to the cache), block-causal without cache ``[0, hi)``, full attention
    the whole canvas. Inside ``[lo, hi)`` attention is bidirectional; before ``lo`` it is
    block-causal.
    """
    n_rows, width = rows.numel(), int((hi - lo).max())
    cached = state.cache is not None
    if model.attention == "full":
        q_start, q_end = torch.zeros_like(lo), state.length[rows]
    else:
        q_start, q_end = (state.cache_len[rows] if cached else torch.zeros_like(lo)), hi
    if cached and (lo < q_start).any():
        raise StrategyError("block schedule moved a window start back into the KV cache")
    span = int((q_end - q_start).max())
    pos = q_end[:, None] - span + torch.arange(span)  # (R, T) absolute, left-padded
    real = pos >= q_start[:, None]
    ids = state.canvas[rows[:, None], pos.clamp(min=0)]  # (R, T)
    if model.attention == "full":
        allowed = real[:, None, :].expand(-1, span, -1)
    else:
        # a position's attention group is its block; the whole window shares the active block's
        group = torch.div(pos - state.origin[rows, None], state.block_length, rounding_mode="floor")
        group = torch.where(pos < state.origin[rows, None], -1, group)
        group = torch.where(pos >= lo[:, None], group[:, -1:], group)
        allowed = real[:, None, :] & (group[:, None, :] <= group[:, :, None])  # (R, T, T)
    allowed = allowed | torch.eye(span, dtype=torch.bool)  # padding queries see themselves: no NaN
    kwargs: dict[str, Any] = {}
    if cached:
        n_cached = int(state.cache_len[rows].max())
        cache_cols = torch.arange(n_cached) < state.cache_len[rows, None]  # (R, S)
        allowed = torch.cat([cache_cols[:, None, :].expand(-1, span, -1), allowed], dim=-1)
        kwargs = dict(cache=state.cache, cache_rows=rows, cache_write=real & (pos < lo[:, None]))
    t0 = perf_counter()
    logits = model.forward_window(ids, pos.clamp(min=0), allowed, **kwargs)  # (R, T, V)
    state.model_time += perf_counter() - t0
    state.forward_calls += 1
    state.counts[rows, FORWARD_TOKENS] += real.sum(1)
    if cached:
        state.cache_len[rows] = lo
    first = (hi - width) - (q_end - span)  # window start inside the padded span
    index = (first[:, None] + torch.arange(width)).clamp(min=0)  # (R, W)
    return logits.gather(1, index[:, :, None].expand(-1, -1, logits.shape[-1]))


def step_context(policy: DecodingPolicy, state: DecodeState, rows: torch.Tensor, start: torch.Tensor, lo: torch.Tensor, logits: torch.Tensor) -> StepContext:
    """The :class:`StepContext` for a window of positions ``start + [0, W)`` (real from ``lo``)."""
    width = logits.shape[1]
    positions = start[:, None] + torch.arange(width)  # (R, W)
    valid = positions >= lo[:, None].clamp(min=0)
    idx = (rows[:, None], positions.clamp(min=0))
    tokens = state.canvas[idx]
    masked = (tokens == state.mask_token_id) & valid
    block_lo, block_hi = state.block_bounds(rows)
    in_block = (positions >= block_lo[:, None]) & (positions < block_hi[:, None])
    is_prompt = positions < state.prompt_len[rows, None]
    sampled, confidence, probs = policy.sample(logits, state.mask_token_id, state.generator)
    ctx = StepContext(
        rows=rows,
        positions=positions,
        tokens=tokens,
        valid=valid,
        masked=masked,
        is_prompt=is_prompt,
        in_block=in_block,
        editable=valid & ~is_prompt & ~masked,
        sampled=sampled,
        confidence=confidence,
        logits=logits,
        written_step=state.written_step[idx],
        written_conf=state.written_conf[idx],
        step=state.nfe[rows],
        block=state.block[rows],
        block_step=state.block_step[rows],
        block_masked_start=state.block_masked_start[rows],
        post=~(masked & in_block).any(1),
        generator=state.generator,
        memory=state.memory,
        mask_token_id=state.mask_token_id,
        eos_token_id=state.eos_token_id,
    )
    ctx.__dict__["probs"] = probs  # StepContext.probs is a cached property: computed once here
    ctx.editable = ctx.editable & policy.blocks.edit_region(state, ctx)
    return ctx


def write(state: DecodeState, ctx: StepContext) -> None:
    """Write commits, edits and remasks of one step at once, and count them."""
    assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
    rows = ctx.rows
    r, w = (ctx.commit | ctx.edit | ctx.remask).nonzero(as_tuple=True)
    remask = ctx.remask[r, w]
    at = (rows[r], ctx.positions[r, w])
    state.canvas[at] = torch.where(remask, state.mask_token_id, ctx.sampled[r, w])
    state.written_step[at] = torch.where(remask, -1, state.nfe[rows[r]])
    state.written_conf[at] = torch.where(remask, 0.0, ctx.confidence[r, w])
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
