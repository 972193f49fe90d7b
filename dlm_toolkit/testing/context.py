"""Build a :class:`StepContext` from hand-made tensors, to test a rule without a model."""

from __future__ import annotations

from typing import Any

import torch

from dlm_toolkit.strategy import StepContext


def make_context(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    *,
    mask_token_id: int,
    eos_token_id: int = -1,
    prompt_len: int | torch.Tensor = 0,
    in_block: torch.Tensor | None = None,
    editable_region: torch.Tensor | None = None,
    block_step: int | torch.Tensor = 0,
    block_masked_start: torch.Tensor | None = None,
    step: int | torch.Tensor = 0,
    written_step: torch.Tensor | None = None,
    seed: int = 0,
    memory: dict[str, Any] | None = None,
) -> StepContext:
    """A context over a window starting at position 0, greedy sampling from ``logits``.

    Args:
        tokens: ``(B, W)`` current window tokens (``mask_token_id`` where masked).
        logits: ``(B, W, V)``; ``sampled``/``confidence`` are its argmax and softmax max.
        prompt_len: positions ``< prompt_len`` are prompt (per row if a tensor).
        in_block: active block positions (default: the whole window).
        editable_region: where T2T/remask may act (default: ``in_block``).
        block_masked_start: masked count when the block began (default: masked now).
    """
    b, w = tokens.shape
    positions = torch.arange(w).expand(b, w)
    valid = torch.ones(b, w, dtype=torch.bool)
    masked = tokens == mask_token_id
    is_prompt = positions < _per_row(prompt_len, b)[:, None]
    in_block = valid if in_block is None else in_block
    region = in_block if editable_region is None else editable_region
    probs = torch.softmax(logits.float(), dim=-1)
    confidence, sampled = probs.max(-1)
    return StepContext(
        rows=torch.arange(b),
        positions=positions,
        tokens=tokens,
        valid=valid,
        masked=masked,
        is_prompt=is_prompt,
        in_block=in_block,
        editable=valid & ~is_prompt & ~masked & region,
        sampled=sampled,
        confidence=confidence,
        logits=logits.float(),
        written_step=written_step if written_step is not None else torch.where(masked | is_prompt, -1, 0),
        written_conf=torch.zeros(b, w),
        step=_per_row(step, b),
        block=torch.zeros(b, dtype=torch.long),
        block_step=_per_row(block_step, b),
        block_masked_start=(masked & in_block).sum(1) if block_masked_start is None else block_masked_start,
        post=~(masked & in_block).any(1),
        generator=torch.Generator().manual_seed(seed),
        memory=memory if memory is not None else {},
        mask_token_id=mask_token_id,
        eos_token_id=eos_token_id,
    )


def _per_row(value: int | torch.Tensor, b: int) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.long)
    return t.expand(b).clone() if t.dim() == 0 else t
