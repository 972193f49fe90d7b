"""An independent transcription of the LLaDA2.1 reference decoding (``generate()`` of the LLaDA2.1 model code, see README.md here), line by line.

Batch 1, the whole prefix recomputed every forward, plain Python control flow: nothing shared
with dlm_toolkit's engine. Tests compare the engine against it, and ``make_mask_fixture.py``
writes golden cases with it. ``logits_fn(ids (1, T), positions (1, T), attn_mask (1, T, T))``
returns ``(1, T, V)`` logits (a model's ``forward_window`` fits).

``mask_in_softmax=False`` reproduces the guard some implementations add (the mask token left out
of the softmax), only to show that it changes decisions.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

LogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class MaskDrawn(RuntimeError):
    """The reference drew the mask token at a position it writes: it would loop without progress."""


def reference_decode(logits_fn: LogitsFn, prompt: list[int], gen_length: int, *, block_length: int,
                     threshold: float, editing_threshold: float, max_post_steps: int, eos_early_stop: bool,
                     mask_id: int, eos_id: int, mask_in_softmax: bool = True) -> dict:
    """``{"output_ids", "nfe", "trace"}`` of the reference ``generate()`` at temperature 0.

    Raises :class:`MaskDrawn` where the reference would commit or edit the mask token itself.
    """
    B, P = block_length, len(prompt)
    nb = math.ceil((P + gen_length) / B)
    x = torch.tensor(prompt + [mask_id] * (nb * B - P))
    nfe, trace = 0, []
    for b in range(P // B, nb):
        lo, hi = b * B, (b + 1) * B
        is_prompt = torch.arange(lo, hi) < P
        post = 0
        while True:
            old = x[lo:hi].clone()
            m = old == mask_id
            if not m.any():
                post += 1
            if post > max_post_steps:
                break  # checked before the forward
            blk = torch.arange(hi) // B
            attn = (blk[None, :] <= blk[:, None])[None]  # block-causal: i sees j iff j's block <= i's
            logits = logits_fn(x[None, :hi], torch.arange(hi)[None], attn)[0, lo:hi].float()
            nfe += 1
            if not mask_in_softmax:
                logits[:, mask_id] = float("-inf")
            p, v = torch.softmax(logits, -1).max(-1)
            commit = m & (p > threshold)  # strict
            fallback = False
            if commit.sum() < 1 and m.any():
                commit = torch.zeros_like(m)
                commit[torch.where(m, p, -1.0).argmax()] = True
                fallback = True
            edit = ~m & ~is_prompt & (p > editing_threshold) & (v != old)
            if ((commit | edit) & (v == mask_id)).any():
                raise MaskDrawn(f"forward {nfe}: the mask token is the argmax at a position the reference writes")
            x[lo:hi] = torch.where(commit | edit, v, old)
            trace.append({"block": b, "masks_before": int(m.sum()), "post": not bool(m.any()), "fallback": fallback,
                          "m2t": (torch.arange(lo, hi)[commit]).tolist(), "t2t": (torch.arange(lo, hi)[edit]).tolist(),
                          "block_after": x[lo:hi].tolist()})
            if not m.any() and not edit.any():
                break
        gen = x[P:hi]
        if eos_early_stop and not (gen == mask_id).any() and (gen == eos_id).any():
            break
    out = x[P : P + gen_length].tolist()
    if eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return {"output_ids": out, "nfe": nfe, "trace": trace}
