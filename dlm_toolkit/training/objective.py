"""The editable-dLLM training objective: one batch (canvas layout, noise, the ``[x_t ; x_0]``
input and its attention mask) and its loss. :func:`dlm_toolkit.training.loop.train` runs it.

The objective
-------------
A training row is laid out exactly like an inference canvas: ``prompt ++ answer ++ EOS ...``
up to the end of the block that holds position ``P + answer_length`` (the last of the
``answer_length + 1`` generated positions ``evaluate()`` asks for), blocks of ``B`` aligned at
absolute position 0. ``B`` is drawn per step from ``block_lengths`` so one model serves every
block length the sweeps use.

Noise (answer and EOS-padding positions only, never the prompt): each block ``b`` draws
``t_b ~ U(mask_rate)``; each of its answer positions becomes the mask token with probability
``t_b``; each remaining answer position is replaced, with probability ``corrupt_rate``, by a
random token different from the original (``corrupt_tokens``: ``answer`` = the task's answer
alphabet plus EOS, i.e. the confusions a model actually makes -- wrong digits, a wrong comma,
a premature or missing EOS; ``printable`` = any printable character plus EOS).

Drafting errors (``alternative_rate``): on tasks with several correct answers
(:meth:`~dlm_toolkit.tasks.base.Task.alternative`) each row also draws another correct answer, and
each unmasked answer position where the two differ takes the other answer's token with
probability ``alternative_rate`` (before the random corruption, which then skips it). That is the
error parallel commits make -- every position plausible alone, the whole a mix of two answers --
and random tokens almost never produce it. The target stays the row's answer, which (the rate
being below one half) is what most of the written coupled positions agree with, so the model
learns to edit the minority of a mix towards the majority.

Input: the BD3-LM formulation. The noisy canvas ``x_t`` and the clean canvas ``x_0`` are fed
as one sequence ``[x_t ; x_0]`` with the same absolute position ids in both halves, under a
boolean attention mask (query may attend key):

* noisy block b -> noisy block b (bidirectional) and clean blocks ``< b``;
* clean block b -> clean blocks ``<= b`` (block-causal, as at inference).

So every noisy block sees exactly what the active block sees at inference: itself plus the
finished blocks before it (teacher-forced with the clean text). Two exact savings: noisy
blocks that hold no answer position are dropped (nothing to learn there) and so is the last
clean block (no noisy block may see it). Logits are read from the noisy half only.

Loss: cross-entropy of the ORIGINAL token at masked positions and at corrupted positions
(weight 1; ``loss_weighting: inverse_t`` multiplies masked positions by ``1 / t_b``, the
ELBO weight; ``uniform`` -- the default -- does not, which has lower variance), normalised by
their count, plus ``clean_weight`` times the mean cross-entropy at unchanged answer positions.
That last term matters for T2T editing: the S preset edits wherever the argmax differs from
the written token (editing threshold 0.0), so the model must also learn to reproduce correct
tokens -- without it their argmax is untrained. The mask-only ablation keeps the same term
(only ``corrupt_rate`` and ``alternative_rate`` differ), so the comparison isolates the
corruption noise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dlm_toolkit.models.masks import block_diffusion_attn_mask
from dlm_toolkit.tasks import Task
from dlm_toolkit.training.config import TrainConfig

__all__ = ["Batch", "Row", "block_diffusion_attn_mask", "canvas_tokens", "corruption_candidates", "loss_fn",
           "make_batch", "random_other_token"]


Row = tuple[list[int], ...]  # (prompt_ids, answer_ids) or (prompt_ids, answer_ids, alternative_ids | None)


class Batch(dict):
    """Tensors of one training batch (a dict with attribute access), all ``(R, T)``:

    ``input_ids``, ``position_ids``, ``attn_mask`` (R, T, T), ``targets`` (original tokens),
    ``noisy`` (token in the x_t half), ``block``, ``valid`` (not row padding), ``answer``
    (a generated position: answer or EOS padding), ``masked``, ``corrupted``, ``t`` (the mask
    rate of the token's block), ``clean_ids`` (the token in x_0 at the same position).
    """

    __getattr__ = dict.__getitem__


def canvas_tokens(prompt_ids: list[int], answer_ids: list[int], answer_length: int, block_length: int,
                  eos_id: int) -> tuple[list[int], int]:
    """``(x_0, P)``: prompt ++ answer ++ EOS up to the end of the block holding position
    ``P + answer_length`` -- the canvas ``evaluate()`` decodes for ``gen_length = answer_length + 1``."""
    P = len(prompt_ids)
    if len(answer_ids) > answer_length:
        raise ValueError(f"answer of {len(answer_ids)} tokens exceeds answer_length={answer_length}")
    length = -(-(P + answer_length + 1) // block_length) * block_length
    return prompt_ids + answer_ids + [eos_id] * (length - P - len(answer_ids)), P


def corruption_candidates(task: Task, tokenizer: Any, eos_id: int, kind: str) -> torch.Tensor:
    """Token ids random corruptions are drawn from (see the module docstring)."""
    if kind == "answer":
        chars = sorted(set(task.answer_alphabet))
    else:
        chars = [chr(c) for c in range(0x20, 0x7F)]
    ids = sorted({tokenizer.convert_tokens_to_ids(ch) for ch in chars} | {eos_id})
    return torch.tensor(ids, dtype=torch.long)


def random_other_token(original: torch.Tensor, candidates: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A token drawn uniformly from ``candidates`` minus ``original`` (elementwise)."""
    K = candidates.numel()
    hit = candidates[None, :] == original.reshape(-1, 1)  # (N, K)
    present = hit.any(1)
    where = hit.float().argmax(1)  # index of the original among the candidates (if present)
    n_choices = K - present.long()
    j = (torch.rand(original.numel(), generator=gen) * n_choices).long().clamp(max=K - 1)
    j = j + (present & (j >= where)).long()  # skip the original
    return candidates[j].reshape(original.shape)


def make_batch(rows: list[Row], answer_length: int, block_length: int, mask_id: int,
               eos_id: int, config: TrainConfig, candidates: torch.Tensor, gen: torch.Generator) -> Batch:
    """One batch from ``(prompt_ids, answer_ids[, alternative_ids])`` rows: canvas, noise,
    ``[x_t ; x_0]``, mask (``alternative_ids``: another correct answer of the same length, or None).

    Each row keeps the noisy blocks that hold answer positions and the clean blocks before the
    last one, then rows are right-padded to a common length (``valid`` marks real tokens).
    """
    B = block_length
    lo_rate, hi_rate = config.mask_rate
    out: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "input_ids", "position_ids", "targets", "noisy", "block", "answer", "masked", "corrupted", "t", "clean_ids")}
    for prompt_ids, answer_ids, *alt in rows:
        x0, P = canvas_tokens(prompt_ids, answer_ids, answer_length, B, eos_id)
        x0 = torch.tensor(x0, dtype=torch.long)
        L = x0.numel()
        pos = torch.arange(L)
        blk = pos // B
        answer = pos >= P
        t = lo_rate + (hi_rate - lo_rate) * torch.rand(L // B, generator=gen)  # per block
        t_pos = t[blk]
        masked = answer & (torch.rand(L, generator=gen) < t_pos)
        swapped = torch.zeros(L, dtype=torch.bool)
        if config.alternative_rate > 0 and alt and alt[0] is not None:
            x_alt = torch.tensor(canvas_tokens(prompt_ids, alt[0], answer_length, B, eos_id)[0], dtype=torch.long)
            swapped = answer & ~masked & (x_alt != x0) & (torch.rand(L, generator=gen) < config.alternative_rate)
        randomised = answer & ~masked & ~swapped & (torch.rand(L, generator=gen) < config.corrupt_rate)
        corrupted = swapped | randomised
        xt = x0.clone()
        xt[masked] = mask_id
        if swapped.any():
            xt[swapped] = x_alt[swapped]
        if randomised.any():
            xt[randomised] = random_other_token(x0[randomised], candidates, gen)
        keep_noisy = blk >= P // B  # blocks holding answer positions
        keep_clean = blk < L // B - 1  # the last clean block is never attended
        n, c = keep_noisy, keep_clean
        out["input_ids"].append(torch.cat([xt[n], x0[c]]))
        out["position_ids"].append(torch.cat([pos[n], pos[c]]))
        out["targets"].append(torch.cat([x0[n], x0[c]]))
        out["noisy"].append(torch.cat([torch.ones(int(n.sum()), dtype=torch.bool), torch.zeros(int(c.sum()), dtype=torch.bool)]))
        out["block"].append(torch.cat([blk[n], blk[c]]))
        out["answer"].append(torch.cat([answer[n], answer[c]]))
        out["masked"].append(torch.cat([masked[n], torch.zeros(int(c.sum()), dtype=torch.bool)]))
        out["corrupted"].append(torch.cat([corrupted[n], torch.zeros(int(c.sum()), dtype=torch.bool)]))
        out["t"].append(torch.cat([t_pos[n], torch.zeros(int(c.sum()))]))
        out["clean_ids"].append(torch.cat([x0[n], x0[c]]))
    T = max(x.numel() for x in out["input_ids"])

    def pad(xs: list[torch.Tensor], value) -> torch.Tensor:
        return torch.stack([F.pad(x, (0, T - x.numel()), value=value) for x in xs])

    batch = Batch(
        input_ids=pad(out["input_ids"], eos_id), position_ids=pad(out["position_ids"], 0),
        targets=pad(out["targets"], eos_id), noisy=pad(out["noisy"], False), block=pad(out["block"], 0),
        answer=pad(out["answer"], False), masked=pad(out["masked"], False),
        corrupted=pad(out["corrupted"], False), t=pad(out["t"], 0.0), clean_ids=pad(out["clean_ids"], eos_id),
        valid=pad([torch.ones(x.numel(), dtype=torch.bool) for x in out["input_ids"]], False),
    )
    batch["attn_mask"] = block_diffusion_attn_mask(batch.noisy, batch.block, batch.valid)
    return batch


def loss_fn(logits: torch.Tensor, batch: Batch, config: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of the module docstring and a few diagnostics (token accuracy at noised positions)."""
    noised = batch.noisy & (batch.masked | batch.corrupted)
    unchanged = batch.noisy & batch.answer & ~batch.masked & ~batch.corrupted
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), reduction="none")
    ce = ce.view_as(batch.targets)
    w = noised.float()
    if config.loss_weighting == "inverse_t":
        w = torch.where(batch.masked, 1.0 / batch.t.clamp(min=1e-3), w)
    loss = (ce * w).sum() / noised.sum().clamp(min=1)
    if config.clean_weight > 0:
        loss = loss + config.clean_weight * (ce * unchanged).sum() / unchanged.sum().clamp(min=1)
    with torch.no_grad():
        right = logits.argmax(-1) == batch.targets
        stats = {
            "masked_acc": float((right & batch.masked).sum() / batch.masked.sum().clamp(min=1)),
            "corrupt_acc": float((right & batch.corrupted).sum() / batch.corrupted.sum().clamp(min=1)),
            "keep_acc": float((right & unchanged).sum() / unchanged.sum().clamp(min=1)),
        }
    return loss, stats
