"""Build a :class:`StepContext` from hand-made tensors, to test a rule without a model."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from dlm_toolkit.config import SamplingConfig
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.hooks.base import StepHook, declaration, declared_outputs
from dlm_toolkit.hooks.shadow import ShadowHook
from dlm_toolkit.step.outputs import Declared
from dlm_toolkit.step.state import row_seeds
from dlm_toolkit.strategy.base import StepContext


def make_context(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    *,
    mask_token_id: int,
    valid: torch.Tensor | None = None,
    eos_token_id: int = -1,
    prompt_len: int | torch.Tensor = 0,
    in_block: torch.Tensor | None = None,
    editable_region: torch.Tensor | None = None,
    block_step: int | torch.Tensor = 0,
    block_masked_start: torch.Tensor | None = None,
    step: int | torch.Tensor = 0,
    written_step: torch.Tensor | None = None,
    written_conf: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    batch_rows: int | None = None,
    seed: int | Sequence[int] = 0,
    sampling: SamplingConfig | None = None,
    memory: dict[str, Any] | None = None,
    shadow_confidence: torch.Tensor | None = None,
    hooks: Sequence[StepHook] = (),
    outputs: Mapping[str, Any] | None = None,
    policy: DecodingPolicy | None = None,
) -> StepContext:
    """A context over a window starting at position 0, built by the engine's own
    :meth:`StepContext.build` (greedy sampling from ``logits`` unless ``sampling`` says otherwise).

    Args:
        tokens: ``(B, W)`` current window tokens (``mask_token_id`` where masked).
        logits: ``(B, W, V)``; ``sampled``/``confidence`` are drawn from them as in a decode.
        valid: real window positions (default all); per row a suffix of the window, the rest
            being left padding as in an engine batch.
        prompt_len: positions ``< prompt_len`` are prompt (per row if a tensor).
        in_block: active block positions (default: the whole window).
        editable_region: where T2T/remask may act (default: ``in_block``).
        block_masked_start: masked count when the block began (default: masked now).
        rows: batch row ids of the context rows (default ``0..B-1``).
        batch_rows: rows in the whole decode batch (default ``max(rows) + 1``).
        seed: the rows' random streams: an int (row r gets ``row_seed(seed, r)``) or one seed per row.
        shadow_confidence: ``(B, W)`` what the engine's shadow block would give (:mod:`dlm_toolkit.hooks.shadow`;
            default unset, as in a policy without a shadow rule).
        hooks: step hooks whose declared outputs ``ctx.hooks`` holds (as a policy with them would).
        outputs: ``{name: value}`` set in ``ctx.hooks`` as the declaring hook would (checked against
            its declaration).
        policy: the policy the hooks declare their outputs under (``hook.declare(policy)``; default:
            ``DecodingPolicy()``, the default preset).
    """
    b, w = tokens.shape
    device = tokens.device
    positions = torch.arange(w, device=device).expand(b, w)
    in_block = torch.ones(b, w, dtype=torch.bool, device=device) if in_block is None else in_block
    rows = torch.arange(b, device=device) if rows is None else rows
    valid = torch.ones(b, w, dtype=torch.bool, device=device) if valid is None else valid
    if (valid[:, 1:] < valid[:, :-1]).any():
        raise ValueError("valid must be a suffix of the window in every row (padding is on the left)")
    masked = (tokens == mask_token_id) & valid
    is_prompt = positions < _per_row(prompt_len, b, device)[:, None]
    ctx = StepContext.build(
        rows=rows,
        positions=positions,
        valid=valid,
        tokens=tokens,
        prompt_len=_per_row(prompt_len, b, device),
        block_lo=torch.where(in_block.any(1), in_block.long().argmax(1), w),
        block_hi=torch.where(in_block.any(1), w - in_block.flip(1).long().argmax(1), w),
        logits=logits,
        sampling=sampling or SamplingConfig(),
        written_step=written_step if written_step is not None else torch.where(masked | is_prompt, -1, 0),
        written_conf=written_conf if written_conf is not None else torch.zeros(b, w, device=device),
        step=_per_row(step, b, device),
        block=torch.zeros(b, dtype=torch.long, device=device),
        block_step=_per_row(block_step, b, device),
        block_masked_start=(masked & in_block).sum(1) if block_masked_start is None else block_masked_start,
        seeds=torch.tensor(row_seeds(seed, b), dtype=torch.long, device=device),
        memory=memory if memory is not None else {},
        mask_token_id=mask_token_id,
        eos_token_id=eos_token_id,
        batch_rows=batch_rows if batch_rows is not None else int(rows.max()) + 1,
        outputs=_declared([*hooks, ShadowHook("make_context")] if shadow_confidence is not None else hooks, policy),
    )
    if not torch.equal(ctx.in_block, in_block):
        raise ValueError("in_block must be one interval of positions per row (the active block)")
    values = dict(outputs or {})
    if shadow_confidence is not None:
        values["shadow_confidence"] = shadow_confidence
    for name, value in values.items():
        ctx.hooks.set(None, name, value)  # as the hook declaring it
    if editable_region is not None:
        ctx.editable = ctx.editable & editable_region
    else:
        ctx.editable = ctx.editable & in_block
    return ctx


def _declared(hooks: Sequence[StepHook], policy: DecodingPolicy | None) -> dict[str, Declared]:
    if not hooks:
        return {}
    policy = DecodingPolicy() if policy is None else policy
    return declared_outputs(hooks, [declaration(h, policy) for h in hooks])


def _per_row(value: int | torch.Tensor, b: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.long, device=device)
    return t.expand(b).clone() if t.dim() == 0 else t
