"""Log-likelihood of a continuation under a masked-diffusion LM: a Monte-Carlo estimate of the ELBO.

A diffusion LM has no tractable ``log p(continuation | context)``; what it has is the masked-
diffusion evidence lower bound, which LLaDA's own evaluation (and Fast-dLLM, dllm) estimate for
lm-eval's multiple-choice tasks. For a block-causal model (LLaDA2) the continuation is scored the
way it is decoded, block by block (blocks of ``B`` aligned at absolute position 0 as in the decode)::

    log p(x | c) >= sum_b  E_{k_b ~ U{1..l_b}, S_b}  (l_b / k_b) * sum_{i in S_b} log p(x_i | c, x_<b, x_b \\ S_b)

``l_b``: continuation positions in block ``b``; ``S_b``: ``k_b`` of them, a uniformly random
subset, replaced by the mask token. Each block sees the context and the earlier blocks clean (the
decode's view when it reaches block ``b``; teacher-forced as in training) and its own unmasked
positions. The end of the sequence is a convention (``last_block``): ``"pad"`` (the default) fills
the last block past the continuation with mask tokens, as in a decode canvas, so the continuation is
scored as the start of a generation (the rest is marginalised); ``"cut"`` ends the sequence at the
continuation's last token, as LLaDA's own estimator does (the last block is then shorter than ``B``).
The two differ by a few nats on short answers, in either direction (the v2 testbed, blocks of 32,
``12+34=`` then ``47``: about -12.6 nats padded, -9.4 cut; ``3+96=`` then ``98``: -7.3, -8.6), so
say which one a number used.
All blocks of one sample go through ONE forward in the ``[x_t ; x_0]`` layout the model was
trained on (:func:`~dlm_toolkit.training.objective.block_diffusion_attn_mask`). A full-attention
model (LLaDA-1 style) is one block holding context and continuation, no padding: LLaDA's estimator.

Samples are i.i.d. (no stratification), so the standard error is the samples' standard
deviation over ``sqrt(mc_num)``. Where no sample can vary -- every block holds one continuation
position, e.g. a one-token continuation -- the bound is exact (``log p`` of that token) and one
forward computes it. ``greedy`` (lm-eval's ``is_greedy``): every continuation token is the argmax
when its whole block's continuation is masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.models.base import DiffusionLM, model_device
from dlm_toolkit.models.masks import block_diffusion_attn_mask
from dlm_toolkit.util.runtime import host_memory_bytes

__all__ = ["LAST_BLOCK", "LoglikEstimate", "MAX_MC_BATCH", "MAX_MC_NUM", "check_forward_memory", "check_last_block",
           "check_mc_args", "estimate_loglikelihood", "forward_length", "forward_shape"]

MAX_MC_NUM = 100_000  # samples per request; LLaDA's evaluation uses 128, dllm up to 1024
MAX_MC_BATCH = 4096  # rows of one forward
LAST_BLOCK = ("pad", "cut")  # how the sequence ends after the continuation (module docstring)


@dataclass(frozen=True)
class LoglikEstimate:
    """One request's estimate: ``logprob`` (nats), its ``stderr`` (0 when ``exact``), the number of
    Monte-Carlo ``samples`` (1 when exact) and lm-eval's ``greedy`` flag."""

    logprob: float
    stderr: float
    samples: int
    exact: bool
    greedy: bool


def _positive_int(value: object, name: str, lo: int, hi: int, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{name}: must be an integer in [{lo}, {hi}]{why} (got {value!r})")
    return value


def check_mc_args(mc_num: object, mc_batch_size: object) -> tuple[int, int]:
    """``(mc_num, mc_batch_size)`` checked: at least two samples (a standard error needs two), at
    most :data:`MAX_MC_NUM`; a batch of 1 to :data:`MAX_MC_BATCH` rows."""
    n = _positive_int(mc_num, "mc_num", 2, MAX_MC_NUM, " (samples per request; a standard error needs two)")
    b = _positive_int(mc_batch_size, "mc_batch_size", 1, MAX_MC_BATCH, " (samples per forward)")
    return n, b


def check_last_block(value: object) -> str:
    """``value`` if it is one of :data:`LAST_BLOCK`, else one line naming the option."""
    if value not in LAST_BLOCK:
        raise ConfigError(f"loglik_last_block: must be one of {', '.join(LAST_BLOCK)} (got {value!r}): pad fills the "
                          "last block with masks as a decode does, cut ends the sequence at the answer as LLaDA's "
                          "estimator does")
    return str(value)


def _layout(model: DiffusionLM, P: int, l: int, block_length: int, last_block: str) -> tuple[int | None, int, int, int]:
    """``(B, L, noisy_from, clean_to)`` of the scoring sequence (module docstring): the block length
    (None for a full-attention model), the padded length, where the noisy half starts and where the
    clean copy ends."""
    full = getattr(model, "attention", "block_causal") == "full"
    B = None if full else int(block_length)
    L = P + l if B is None or last_block == "cut" else -(-(P + l) // B) * B
    noisy_from = 0 if B is None else (P // B) * B  # blocks holding continuation positions
    clean_to = 0 if B is None else (L - 1) // B * B  # the last block's clean copy is never attended
    return B, L, noisy_from, clean_to


def forward_length(model: DiffusionLM, P: int, l: int, block_length: int, last_block: str = "pad") -> int:
    """Positions of one scoring forward for a context of ``P`` and a continuation of ``l`` tokens."""
    _, L, noisy_from, clean_to = _layout(model, P, l, block_length, last_block)
    return L - noisy_from + clean_to


def forward_shape(model: DiffusionLM, P: int, l: int, block_length: int, mc_num: int, mc_batch_size: int,
                  last_block: str = "pad") -> tuple[int, int]:
    """``(rows, length)`` of the largest scoring forward of one request: one row where the estimate
    is exact, else a batch of samples and the greedy row that rides along the first."""
    B = _layout(model, P, l, block_length, last_block)[0]
    exact = l == 0 or all(g.numel() == 1 for g in _groups(P, l, B))
    return (1 if exact else min(mc_batch_size, mc_num) + 1), forward_length(model, P, l, block_length, last_block)


def forward_bytes(model: DiffusionLM, rows: int, length: int) -> int:
    """The bytes one scoring forward of ``rows`` x ``length`` positions allocates in its two
    largest tensors, which grow past the weights first: the logits ((rows, length, V) in the
    model's dtype and again in float32) and the attention's additive mask ((rows, length,
    length) in the model's dtype, next to the bool one)."""
    size = torch.empty((), dtype=getattr(model, "dtype", torch.float32)).element_size()
    return rows * length * (int(model.vocab_size) * (size + 4) + length * (size + 1))


def memory_for_forwards(model: DiffusionLM) -> int:
    """The bytes a scoring forward may take: half of this machine's memory for a model on the CPU
    (:func:`~dlm_toolkit.util.runtime.host_memory_bytes`), the device's memory for one on a GPU."""
    device = model_device(model)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return host_memory_bytes() // 2


def check_forward_memory(model: DiffusionLM, rows: int, length: int, budget: int | None = None) -> None:
    """Refuse, before any forward, a scoring forward of ``rows`` (``mc_batch_size`` samples and
    the greedy row) over ``length`` positions whose logits and mask (:func:`forward_bytes`) need
    more than ``budget`` bytes (default :func:`memory_for_forwards`).

    Raises:
        ConfigError: one line with the estimate, the budget and the largest ``mc_batch_size`` that fits.
    """
    budget = memory_for_forwards(model) if budget is None else budget
    need = forward_bytes(model, rows, length)
    if need <= budget:
        return
    fits = budget // max(1, forward_bytes(model, 1, length)) - 1  # samples besides the greedy row
    advice = (f"use mc_batch_size <= {fits}" if fits >= 1 else
              "even one sample does not fit: shorten the request (context + continuation)")
    raise ConfigError(f"mc_batch_size: a loglikelihood forward of {rows} rows over {length} positions needs "
                      f"~{need / 2**30:.1f} GiB for its logits and attention mask, more than the "
                      f"{budget / 2**30:.1f} GiB allowed (half of this machine's memory, or the GPU's): {advice}")


def _groups(P: int, l: int, block: int | None) -> list[torch.Tensor]:
    """Continuation offsets (0..l-1) grouped by block; one group for a full-attention model."""
    if block is None:
        return [torch.arange(l)]
    blocks = (P + torch.arange(l)) // block
    return [torch.nonzero(blocks == b).flatten() for b in torch.unique(blocks)]


def _draw(groups: list[torch.Tensor], l: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked, weight)``, both ``(n, l)``: per sample and block, ``k ~ U{1..l_b}`` positions of a
    uniformly random subset are masked, each weighted ``l_b / k``."""
    masked = torch.zeros(n, l, dtype=torch.bool)
    weight = torch.zeros(n, l)
    for idx in groups:
        size = idx.numel()
        k = torch.randint(1, size + 1, (n, 1), generator=gen)
        rank = torch.rand(n, size, generator=gen).argsort(1).argsort(1)  # a uniform random order
        hit = rank < k
        masked[:, idx] = hit
        weight[:, idx] = torch.where(hit, size / k.float(), torch.zeros(()))
    return masked, weight


def estimate_loglikelihood(model: DiffusionLM, context: Sequence[int], continuation: Sequence[int],
                           block_length: int, *, mc_num: int = 128, mc_batch_size: int = 32,
                           generator: torch.Generator | None = None, last_block: str = "pad",
                           progress: Callable[[int], None] | None = None) -> LoglikEstimate:
    """Estimate ``log p(continuation | context)`` (the ELBO of the module docstring).

    Args:
        model: any :class:`~dlm_toolkit.models.base.DiffusionLM` (``attention`` block-causal or full).
        context, continuation: token ids; an empty continuation has log-likelihood 0 exactly.
        block_length: the decode's block length (ignored by a full-attention model).
        mc_num, mc_batch_size: samples, and samples per forward (:func:`check_mc_args`).
        generator: CPU generator the masks are drawn from (seed it for reproducible estimates).
        last_block: ``"pad"`` (masks to the end of the last block) or ``"cut"`` (the sequence ends
            at the continuation): see the module docstring.
        progress: called with the number of samples each forward settles (``mc_num`` in all, the
            exact case and an empty continuation included), for a progress bar over samples.
    """
    mc_num, mc_batch_size = check_mc_args(mc_num, mc_batch_size)
    last_block = check_last_block(last_block)
    P, l = len(context), len(continuation)
    done = progress or (lambda k: None)
    if l == 0:
        done(mc_num)
        return LoglikEstimate(0.0, 0.0, 1, True, True)
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    B, L, noisy_from, clean_to = _layout(model, P, l, block_length, last_block)
    mask_id = int(model.mask_token_id)
    x0 = torch.tensor([*context, *continuation] + [mask_id] * (L - P - l), dtype=torch.long)
    pos = torch.arange(L)
    blk = torch.zeros(L, dtype=torch.long) if B is None else pos // B
    T_noisy = L - noisy_from
    flags = torch.cat([torch.ones(T_noisy, dtype=torch.bool), torch.zeros(clean_to, dtype=torch.bool)])
    blocks = torch.cat([blk[noisy_from:], blk[:clean_to]])
    positions = torch.cat([pos[noisy_from:], pos[:clean_to]])
    attn = block_diffusion_attn_mask(flags[None], blocks[None], torch.ones_like(flags)[None])[0]
    target = torch.tensor(list(continuation), dtype=torch.long)
    cont_at = P - noisy_from + torch.arange(l)  # the continuation's slots in the noisy half

    groups = _groups(P, l, B)
    exact = all(g.numel() == 1 for g in groups)
    check_forward_memory(model, *forward_shape(model, P, l, block_length, mc_num, mc_batch_size, last_block))
    device = model_device(model)
    attn, positions = attn.to(device), positions.to(device)  # one copy, broadcast over the samples

    def score(masked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-position log p of the target, and its argmax, for rows of masked continuations."""
        n = masked.shape[0]
        noisy = x0[noisy_from:].repeat(n, 1)
        noisy[:, cont_at] = torch.where(masked, torch.full_like(target, mask_id), target)
        ids = torch.cat([noisy, x0[:clean_to].repeat(n, 1)], 1).to(device)
        with torch.inference_mode():
            logits = model.forward_window(ids, positions.expand(n, -1), attn.expand(n, -1, -1))
            at = logits[:, cont_at.to(device)].float()
            logp = torch.log_softmax(at, -1).gather(-1, target.to(device)[None, :, None].expand(n, l, 1))[..., 0]
            return logp.cpu(), at.argmax(-1).cpu()

    everything = torch.ones(1, l, dtype=torch.bool)  # the greedy check's row rides along the first batch
    if exact:
        logp, argmax = score(everything)
        done(mc_num)
        return LoglikEstimate(float(logp[0].sum()), 0.0, 1, True, bool((argmax[0] == target).all()))
    values, greedy = [], False
    for start in range(0, mc_num, mc_batch_size):
        masked, weight = _draw(groups, l, min(mc_batch_size, mc_num - start), gen)
        first = start == 0
        logp, argmax = score(torch.cat([everything, masked]) if first else masked)
        if first:
            greedy, logp = bool((argmax[0] == target).all()), logp[1:]
        values.append((logp.double() * weight.double()).sum(1))
        done(masked.shape[0])
    v = torch.cat(values)
    return LoglikEstimate(float(v.mean()), float(v.std(unbiased=True)) / math.sqrt(mc_num), mc_num, False, greedy)
