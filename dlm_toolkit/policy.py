"""A decoding policy: four roles composed, sampling, and the invariants every step must keep."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from dlm_toolkit.config import PolicyConfig, RoleSpec, SamplingConfig, load_policy
from dlm_toolkit.registry import REGISTRIES
from dlm_toolkit.selection import remaskable
from dlm_toolkit.strategy import (
    BlockSchedule,
    EditRule,
    RemaskRule,
    Selection,
    StepContext,
    Strategy,
    UnmaskRule,
)


class StrategyError(RuntimeError):
    """A rule broke its role's contract (wrong shape, forbidden positions, no progress)."""


class DecodingPolicy:
    """M2T + T2T + block schedule + remask + sampling, with the invariants enforced.

    Build from a config (preset name, file, dict, :class:`PolicyConfig`) or from strategy
    objects with :meth:`from_rules`. Holds no per-decode state: safe to share.
    """

    def __init__(self, config: PolicyConfig | str | Mapping[str, Any] | None = None, **overrides: Any):
        self.config = load_policy(config, overrides)
        self.m2t: UnmaskRule = self._build("m2t")
        self.t2t: EditRule = self._build("t2t")
        self.blocks: BlockSchedule = self._build("blocks")
        self.remask: RemaskRule = self._build("remask")
        self.sampling: SamplingConfig = self.config.sampling

    def _build(self, role: str) -> Any:
        spec: RoleSpec = getattr(self.config, role)
        return REGISTRIES[role].get(spec.name)(spec.params)

    @classmethod
    def from_rules(
        cls,
        m2t: UnmaskRule,
        blocks: BlockSchedule,
        t2t: EditRule | None = None,
        remask: RemaskRule | None = None,
        sampling: SamplingConfig | Mapping[str, Any] | None = None,
    ) -> DecodingPolicy:
        """A policy from rule objects (e.g. a rule class defined in a notebook)."""
        data: dict[str, Any] = {"m2t": _spec(m2t), "blocks": _spec(blocks)}
        if t2t is not None:
            data["t2t"] = _spec(t2t)
        if remask is not None:
            data["remask"] = _spec(remask)
        if sampling is not None:
            data["sampling"] = sampling if isinstance(sampling, Mapping) else sampling.model_dump()
        return cls(data)

    def __repr__(self) -> str:
        return f"DecodingPolicy({self.config.canonical_json()})"

    # -- sampling ------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, mask_token_id: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sampled, confidence, probs) for ``(B, W, V)`` float32 logits (modified in place).

        Greedy at temperature 0; else Gumbel-max over top-k/top-p-filtered tempered logits
        (in float64 when ``gumbel_float64``, as LLaDA does). Confidence is the untempered
        softmax probability of the drawn token; ``probs`` is that untempered softmax.
        """
        cfg = self.sampling
        if cfg.suppress_mask:
            logits[..., mask_token_id] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if cfg.temperature == 0.0:
            confidence, sampled = probs.max(dim=-1)
            return sampled, confidence, probs
        scores = logits / cfg.temperature
        if cfg.top_k > 0 and cfg.top_k < scores.shape[-1]:
            kth = scores.topk(cfg.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if cfg.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
            drop_sorted = (cum - torch.softmax(sorted_scores, dim=-1)) >= cfg.top_p  # keep the first over p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        dtype = torch.float64 if cfg.gumbel_float64 else torch.float32
        u = torch.rand(scores.shape, generator=generator, dtype=dtype).clamp_(min=1e-20)
        sampled = (scores.to(dtype) - torch.log(-torch.log(u))).argmax(dim=-1)
        confidence = probs.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
        return sampled, confidence, probs

    # -- one step ------------------------------------------------------------------------
    def step(self, ctx: StepContext, memory: dict[str, Any]) -> None:
        """Run the rules in order, check each against its contract, fill ``ctx.commit/edit/remask``."""
        ctx.commit = self._run(self.m2t, ctx, memory, ctx.fillable, "fillable (masked and in the active block)")
        has_masks = ctx.fillable.any(1)
        stalled = has_masks & ~ctx.commit.any(1)
        if stalled.any():
            r = int(stalled.nonzero()[0, 0])
            raise StrategyError(
                f"m2t rule '{self.m2t.name}' committed nothing in batch row {int(ctx.rows[r])} although its "
                f"active block has {int(ctx.fillable[r].sum())} masked positions (every step must make progress)"
            )
        ctx.edit = self._run(self.t2t, ctx, memory, ctx.editable, "editable (written, non-prompt, in the edit window)")
        ctx.remask = self._run(self.remask, ctx, memory, remaskable(ctx), "remaskable (written, in the active block, not edited now, block has masks)")
        if ctx.remask.any():
            net = ctx.commit.sum(1) - ctx.remask.sum(1)
            bad = has_masks & (net < 1)
            if bad.any():
                r = int(bad.nonzero()[0, 0])
                raise StrategyError(
                    f"remask rule '{self.remask.name}' remasked {int(ctx.remask[r].sum())} positions in batch row "
                    f"{int(ctx.rows[r])} but only {int(ctx.commit[r].sum())} were committed (net progress must be >= 1)"
                )

    @staticmethod
    def _run(rule: Strategy, ctx: StepContext, memory: dict[str, Any], allowed: torch.Tensor, what: str) -> torch.Tensor:
        out = rule(ctx)
        if isinstance(out, Selection):
            memory[rule.role] = out.memory
            out = out.select
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool or out.shape != allowed.shape:
            got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise StrategyError(
                f"{rule.role} rule '{rule.name}' must return a bool tensor of shape {tuple(allowed.shape)} "
                f"(or a Selection), got {got}"
            )
        outside = out & ~allowed
        if outside.any():
            r, w = (int(v) for v in outside.nonzero()[0])
            raise StrategyError(
                f"{rule.role} rule '{rule.name}' selected position {int(ctx.positions[r, w])} of batch row "
                f"{int(ctx.rows[r])}, which is not {what}"
            )
        return out


def _spec(rule: Strategy) -> dict[str, Any]:
    return rule.spec().model_dump()
