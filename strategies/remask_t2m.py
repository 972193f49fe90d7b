"""Remask ``t2m``: token-to-mask, re-mask a written token whose support collapsed since it was written.

Driven by each token's own history.

Paper: T2M remasking (arXiv 2604.18738; training-free, reported up to +5.92 on CMATH with
LLaDA2.1). A written token x_i of the active block carries the confidence it was written with,
c_i = ``ctx.written_conf``, and the step that wrote it, ``ctx.written_step``; the model's
probability for it now is p_i = ``ctx.token_confidence``. It is turned back into a mask iff

    p_i < drop * c_i   (its support fell to a fraction of what it was)   and   p_i < floor,

and it was written at least ``min_age`` forwards ago (a token gets that many forwards of
context before it is judged). A token the model now wants to *replace* with a confident
alternative is T2T's to edit; T2M acts where no alternative is confident, so the position is
re-opened instead. Largest collapse (lowest p_i / c_i) first, at most (commits this step - 1)
per row so every step keeps net progress, and only while the block still has masks (the remask
contract).

Choices: the history used is the one the step context carries (confidence and step at writing;
no per-decode memory), ``drop`` = 0.5, ``floor`` = 0.5 and ``min_age`` = 1 are our defaults.
"""

from __future__ import annotations

import torch
from pydantic import Field

from dlm_toolkit import REMASK, RemaskRule, StepContext, StrategyConfig
from dlm_toolkit.strategy.selection import remask_budget, remaskable, topk_per_row


@REMASK.register("t2m")
class TokenToMaskRemask(RemaskRule):
    class Config(StrategyConfig):
        drop: float = Field(0.5, gt=0.0, le=1.0, description="re-mask iff p(token now) < drop * confidence it was written with")
        floor: float = Field(0.5, gt=0.0, le=1.0, description="... and p(token now) < floor")
        min_age: int = Field(1, ge=0, le=1024, description="forwards since the token was written before it is judged")

    def __call__(self, ctx: StepContext) -> torch.Tensor:
        cfg = self.config
        now, then = ctx.token_confidence, ctx.written_conf
        old_enough = (ctx.step[:, None] - ctx.written_step) >= cfg.min_age
        collapsed = (now < cfg.drop * then) & (now < cfg.floor)
        ratio = now / then.clamp(min=1e-12)
        return topk_per_row(-ratio, remaskable(ctx) & old_enough & collapsed, remask_budget(ctx))
