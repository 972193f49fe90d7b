"""S2D2, "Fast Decoding for Diffusion LLMs via Training-Free Self-Speculation" (Han, Wang, Gao, Xu,
Srivastava; arXiv 2603.25702), as an M2T rule with a verification forward (``m2t: s2d2``).

The paper's observation: a block-diffusion model with block size one is autoregressive, so the same
model drafts (block diffusion) and verifies (autoregressive mode). One S2D2 step (the paper's
self-speculative step; its public code, ``generate_ssd_policy`` for LLaDA2.1, which we follow):

1. *draft* (the step's forward): every masked position of the active block gets its drawn token
   ``x_i`` with drafter probability ``p_i = p(x_i | canvas)``; this step's T2T edits are applied;
2. *route*: verify iff the first contiguous run of masked positions of the block (the *span*) is at
   least ``min_span_length`` long (the paper's ``mask_span_length`` routing policy, default 1:
   verify whenever the block has a mask); otherwise commit as LLaDA2.1 does (``threshold``, at least
   the most confident mask);
3. *verify* (one more forward, :func:`dlm_toolkit.hooks.verify.verify_forward`): the "2L verifier",
   ``[draft | all-mask copy]`` with token-causal attention, giving ``q_i = p_AR(x_i | prefix,
   draft_<i)`` for every ``i`` of the span;
4. *accept* (speculative rejection sampling over the span, left to right): accept ``x_i`` iff
   ``u_i < min(1, (q_i / p_i)^e)`` (``e``: ``ratio_exponent``); keep the accepted prefix up to the first rejection ``r``
   and write ``r`` too, with a token drawn from the residual ``norm(max(q - p, 0))`` (from ``q`` when
   the residual has no mass). Every verified step therefore writes at least one position.

Defaults (the public code's): ``threshold`` 0.95 (the no-verification commit rule),
``min_span_length`` 1, ``ratio_exponent`` (``ssd_ratio_tempering_factor``) 1.0, rejection sampling.
Where the paper leaves a choice open, or this toolkit differs:

* ``p`` and ``q`` are softmaxes at the policy's sampling temperature, of the raw logits at
  temperature 0 (the public code does the same: at temperature 0 it still accepts with the
  probability ratio, so S2D2 draws random numbers even when greedy). Top-k/top-p do not enter
  the ratio here. ``acceptance: greedy`` is a deterministic variant we add: accept iff
  ``argmax q == x_i``, write ``argmax q`` at the first rejection.
* The mask token never is a residual draw (its probability is zeroed first); a residual with no
  mass outside it keeps the drafted token.
* The paper's other routing policies (expected-acceptance score with or without hysteresis) are not
  implemented; the hysteresis one needs memory across steps.
* Uniform draws come from the verifier's own counter-based stream
  (:func:`dlm_toolkit.hooks.verify.verify_uniform`): ``u`` with draw 0, the residual's Gumbel noise with
  draw 1, so a row decodes the same in any batch.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from dlm_toolkit import M2T, StepContext
from dlm_toolkit.hooks.verify import Verifier, sampling_temperature, temperature_probs, verify_uniform
from strategies.m2t_threshold import ThresholdUnmask


def first_span(fillable: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the first contiguous run of ``fillable`` positions of each row."""
    started = fillable.long().cumsum(1) > 0
    return started & ((~fillable & started).long().cumsum(1) == 0)


@M2T.register("s2d2")
class S2D2(ThresholdUnmask, Verifier):
    """Draft the block, verify its first mask span in autoregressive mode, keep the accepted prefix."""

    class Config(ThresholdUnmask.Config):
        threshold: float = Field(0.95, gt=0.0, le=1.0,
                                 description="commit iff confidence > threshold in steps that do not verify")
        min_span_length: int = Field(1, ge=1, le=4096,
                                     description="verify iff the first mask span of the block has at least this many positions")
        ratio_exponent: float = Field(1.0, gt=0.0, le=10.0,
                                      description="accept iff u < (q/p)^ratio_exponent (the code's ssd_ratio_tempering_factor)")
        acceptance: Literal["rejection", "greedy"] = Field(
            "rejection", description="rejection: speculative rejection sampling (paper); greedy: argmax agreement")

    def wants_verify(self, ctx: StepContext) -> torch.Tensor:
        return first_span(ctx.fillable).sum(1) >= self.config.min_span_length

    def accept(self, ctx: StepContext, draft: torch.Tensor, verify_logits: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        span = first_span(ctx.fillable)
        temperature = sampling_temperature(ctx)
        q_all = temperature_probs(verify_logits, temperature)
        q_all = q_all.masked_fill(ids_equal(q_all, ctx.mask_token_id), 0.0)
        if self.config.acceptance == "greedy":
            best = q_all.argmax(-1)
            accepted = best == draft
            replacement = best
        else:
            p_all = temperature_probs(ctx.logits, temperature)
            q = q_all.gather(-1, draft[..., None])[..., 0]
            p = p_all.gather(-1, draft[..., None])[..., 0].clamp_min(1e-12)
            ratio = (q / p).pow(self.config.ratio_exponent).clamp(max=1.0)
            accepted = verify_uniform(ctx, draw=0) < ratio
            residual = (q_all - p_all).clamp_min(0.0).masked_fill(ids_equal(q_all, ctx.mask_token_id), 0.0)
            has_mass = residual.sum(-1, keepdim=True) > 0
            weights = torch.where(has_mass, residual, q_all)
            gumbel = -torch.log(-torch.log(verify_uniform(ctx, q_all.shape[-1], draw=1).clamp_min(1e-30)))
            drawn = torch.where(weights > 0, weights.log() + gumbel, -torch.inf).argmax(-1)
            replacement = torch.where(weights.sum(-1) > 0, drawn, draft)
        rejected = span & ~accepted
        before = rejected.long().cumsum(1) == 0
        first_rejected = rejected & (rejected.long().cumsum(1) == 1)
        commit = span & (before | first_rejected)
        return commit, torch.where(first_rejected, replacement, draft)


def ids_equal(probs: torch.Tensor, token: int) -> torch.Tensor:
    """(1, 1, V) bool: the vocabulary column of ``token``."""
    return (torch.arange(probs.shape[-1], device=probs.device) == token).view(1, 1, -1)
