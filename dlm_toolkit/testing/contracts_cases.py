"""Random step contexts for the contract suites: a random batch of windows (:func:`random_case`),
its :class:`~dlm_toolkit.strategy.base.StepContext` (:func:`build_context`) and the same case one step
later (:func:`advance`)."""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

import torch

from dlm_toolkit.strategy.selection import top1
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.strategy.base import Selection, StepContext, Strategy
from dlm_toolkit.testing.context import make_context

STEPS = 3  # consecutive steps per random case (memory carries across them)


def random_case(seed: int) -> dict[str, Any]:
    """A random batch of windows as plain tensors (build contexts from it with :func:`build_context`).

    Window ``[0, W)`` with the active block ``[lo, W)``; per row left padding (positions outside
    the window) before the block, a prompt length, masks in the non-prompt part of the block (none,
    some or all) and sometimes before it (a rule must not commit those), written tokens elsewhere;
    logits of one kind: flat, peaked, mixed scales, exactly uniform or one-hot, with the mask
    token's logit sometimes the largest (a degenerate model). Sometimes the edit window spans the
    whole window (multi-block editing).
    """
    g = random.Random(seed)
    tg = torch.Generator().manual_seed(seed)
    b, w, v = g.choice([1, 2, 3, 3, 4]), g.randint(2, 12), g.randint(6, 16)
    mask_id, eos_id = v - 1, v - 2
    lo = g.randint(0, w - 1) if g.random() < 0.3 else g.randint(0, w // 2)
    pos = torch.arange(w)
    in_block = (pos >= lo).expand(b, w).clone()
    pad = torch.tensor([g.randint(0, lo) if g.random() < 0.3 else 0 for _ in range(b)])
    valid = pos[None, :] >= pad[:, None]
    prompt_len = torch.tensor([w if g.random() < 0.1 else g.choice([0, 1, lo, g.randint(0, lo + 1)]) for _ in range(b)])
    is_prompt = pos[None, :] < prompt_len[:, None]
    rate = torch.tensor([g.choice([0.0, 0.3, 0.6, 0.8, 1.0, 1.0]) for _ in range(b)])[:, None]
    masked = in_block & ~is_prompt & (torch.rand(b, w, generator=tg) < rate)
    if g.random() < 0.4:  # masks outside the active block: never fillable
        masked |= valid & ~in_block & ~is_prompt & (torch.rand(b, w, generator=tg) < 0.5)
    tokens = torch.randint(0, v - 1, (b, w), generator=tg).masked_fill(masked, mask_id)
    kind = g.choice(["flat", "peaked", "mixed", "mixed", "mixed", "uniform", "onehot"])
    if kind == "uniform":
        logits = torch.zeros(b, w, v)
    elif kind == "onehot":
        logits = torch.zeros(b, w, v).scatter(-1, torch.randint(0, v - 1, (b, w, 1), generator=tg), 30.0)
    else:
        scale = {"flat": 0.3, "peaked": 6.0}.get(kind) or torch.rand(b, w, 1, generator=tg) * 8
        logits = torch.randn(b, w, v, generator=tg) * scale
    mask_wins = torch.rand(b, w, generator=tg) < (0.3 if g.random() < 0.3 else 0.0)
    logits[..., mask_id] = torch.where(mask_wins, logits.max(-1).values + 1.0, logits[..., mask_id] - 2.0)
    written = valid & ~masked & ~is_prompt
    n_gen_block = (in_block & ~is_prompt).sum(1)
    n_masked = (masked & in_block).sum(1)
    block_step = torch.tensor([g.randint(0, w + 2) for _ in range(b)])
    step = block_step + torch.tensor([g.randint(0, 20) for _ in range(b)])
    return dict(
        tokens=tokens,
        logits=logits,
        mask_token_id=mask_id,
        eos_token_id=eos_id,
        valid=valid,
        prompt_len=prompt_len,
        in_block=in_block,
        editable_region=torch.ones(b, w, dtype=torch.bool) if g.random() < 0.3 else in_block.clone(),
        block_step=block_step,
        block_masked_start=n_masked + ((n_gen_block - n_masked).float() * g.random()).long(),
        step=step,
        written_step=torch.where(written, (torch.rand(b, w, generator=tg) * step[:, None]).long(), -1),
        written_conf=torch.where(written, torch.rand(b, w, generator=tg), 0.0),
        # as the engine's shadow block gives it (dlm_toolkit.hooks.shadow): written tokens of the active block
        shadow_confidence=torch.where(written & in_block, torch.rand(b, w, generator=tg), 0.0),
    )


PER_ROW = ("tokens", "logits", "valid", "prompt_len", "in_block", "editable_region", "block_step",
           "block_masked_start", "step", "written_step", "written_conf", "shadow_confidence")


def build_context(case: Mapping[str, Any], rows: Sequence[int] | None = None, *, seed: int = 0,
                  memory: dict[str, Any] | None = None) -> StepContext:
    """A :class:`StepContext` for ``case`` (or only its ``rows``, keeping their batch-row ids and
    their random streams: row i draws from ``row_seed(seed, i)`` alone or in the batch)."""
    n = case["tokens"].shape[0]
    idx = torch.arange(n) if rows is None else torch.as_tensor(list(rows))
    part = {k: case[k][idx] for k in PER_ROW}
    return make_context(mask_token_id=case["mask_token_id"], eos_token_id=case["eos_token_id"],
                        seed=[row_seed(seed, int(i)) for i in idx], rows=idx.clone(), batch_rows=n,
                        memory=memory if memory is not None else {}, **part)


def advance(case: dict[str, Any], ctx: StepContext, seed: int) -> dict[str, Any]:
    """The case one step later: commits/edits written, remasks applied, logits nudged at some positions."""
    tg = torch.Generator().manual_seed(seed)
    new = dict(case)
    tokens = torch.where(ctx.commit | ctx.edit, ctx.sampled, case["tokens"])
    new["tokens"] = tokens.masked_fill(ctx.remask, case["mask_token_id"])
    wrote = ctx.commit | ctx.edit
    new["written_step"] = torch.where(wrote, case["step"][:, None], case["written_step"]).masked_fill(ctx.remask, -1)
    new["written_conf"] = torch.where(wrote, ctx.confidence, case["written_conf"]).masked_fill(ctx.remask, 0.0)
    nudge = (torch.rand(case["tokens"].shape, generator=tg) < 0.5)[..., None]
    noise = torch.randn(case["logits"].shape, generator=tg) * 0.05
    new["logits"] = torch.where(nudge, case["logits"] + noise, case["logits"])
    new["block_step"] = case["block_step"] + 1
    new["step"] = case["step"] + 1
    return new


def _commit_for(ctx: StepContext, threshold: float) -> torch.Tensor:
    """A threshold M2T selection with the top-1 fallback (stands in for the policy's m2t)."""
    commit = ctx.fillable & (ctx.confidence > threshold)
    need = ctx.fillable.any(1) & ~commit.any(1)
    return commit | (top1(ctx.confidence, ctx.fillable) & need[:, None])


def _as_tensor(rule: Strategy, out: Any) -> tuple[torch.Tensor, Any]:
    select, memory = (out.select, out.memory) if isinstance(out, Selection) else (out, None)
    assert isinstance(select, torch.Tensor), f"{rule!r} returned {type(select).__name__}, expected a bool tensor or Selection"
    return select, memory
