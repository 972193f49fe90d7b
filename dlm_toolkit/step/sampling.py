"""Drawing a token and its confidence at every window position from the logits.

Exactly the reference's arithmetic: the softmax covers the whole vocabulary, ``<|mask|>``
included, and the confidence of a drawn token is its probability under that untempered softmax
(LLaDA, Fast-dLLM and LLaDA2.1 all do this). Keeping the mask token inside the softmax matters:
removing it rescales every confidence by ``1 / (1 - p_mask)``, which flips threshold and fallback
decisions whenever two candidates are closer than that.

The one place where we deliberately differ from the reference: where the drawn token *is* the
mask token (a degenerate model, or an unlucky draw), the best non-mask token of the same softmax
is written instead, with its own probability as confidence. The reference would "commit" the
mask id there, which changes nothing, and loops until its step limit; we always write a real
token, so every commit makes progress and no output ever contains the mask id.
"""

from __future__ import annotations

from typing import Callable

import torch

from dlm_toolkit.config import SamplingConfig

# (B, W, V) uniforms in [0, 1) of a dtype, keyed per row (StepContext.rand, dlm_toolkit.step.rng)
RandFn = Callable[..., torch.Tensor]


def sample(
    logits: torch.Tensor, config: SamplingConfig, mask_token_id: int, rand: RandFn
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sampled, confidence, probs)`` for ``(B, W, V)`` logits (any float dtype).

    Greedy at temperature 0; else Gumbel-max over top-k/top-p-filtered tempered logits (noise in
    float64 when ``gumbel_float64``, as LLaDA does). ``probs`` is the float32 softmax of the
    untempered logits; ``confidence`` is ``probs`` at the written token.
    """
    # (B, W, V), mask token included; float32 logits as they are (float() of them is one more op, same values)
    probs = torch.softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)
    never_mask = 0 <= mask_token_id < probs.shape[-1]
    if config.temperature == 0.0:
        if never_mask:  # greedy: the argmax outside the mask column is what _never_the_mask would give
            confidence, sampled = _max_without(probs, mask_token_id)
            return sampled, confidence, probs
        confidence, sampled = probs.max(dim=-1)
    else:
        scores = tempered_scores(logits.float(), config)
        dtype = torch.float64 if config.gumbel_float64 else torch.float32
        u = rand(scores.shape[-1], dtype=dtype).clamp_(min=1e-20)
        sampled = (scores.to(dtype) - torch.log(-torch.log(u))).argmax(dim=-1)
        confidence = probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    if never_mask:
        sampled, confidence = _never_the_mask(probs, sampled, confidence, mask_token_id)
    return sampled, confidence, probs


def _max_without(probs: torch.Tensor, column: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the max over the last dim with ``column`` left out (``probs`` is
    restored). ``max`` returns the first maximal index, so this equals the full argmax wherever that
    is not ``column``, and the best other token where it is: greedy + :func:`_never_the_mask` in
    four small ops instead of nine (one when ``column`` is the last, as in most mask-token vocabularies:
    the max over the others is a slice)."""
    if column == probs.shape[-1] - 1 and column > 0:
        return probs[..., :column].max(dim=-1)
    col = probs[..., column]
    saved = col.clone()
    col.fill_(-1.0)
    values, indices = probs.max(dim=-1)
    col.copy_(saved)
    return values, indices


def _never_the_mask(probs: torch.Tensor, sampled: torch.Tensor, confidence: torch.Tensor, mask_token_id: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``sampled`` is the mask token, the most probable other token and its probability.

    Computed for every position with ``torch.where`` (one extra max over the vocabulary) rather
    than only where needed, which would need a host sync to find those positions.
    """
    p_mask = probs[..., mask_token_id].clone()
    probs[..., mask_token_id] = -1.0
    alt_conf, alt = probs.max(dim=-1)
    probs[..., mask_token_id] = p_mask
    drew_mask = sampled == mask_token_id
    return torch.where(drew_mask, alt, sampled), torch.where(drew_mask, alt_conf, confidence)


def tempered_scores(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """``logits / temperature`` with everything outside the top-k / top-p nucleus at ``-inf``."""
    scores = logits / config.temperature
    if 0 < config.top_k < scores.shape[-1]:
        kth = scores.topk(config.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        p_sorted = torch.softmax(sorted_scores, dim=-1)
        drop_sorted = (p_sorted.cumsum(-1) - p_sorted) >= config.top_p  # keep the first token past p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores
