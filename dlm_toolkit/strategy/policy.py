"""A decoding policy: four roles composed, sampling, and the invariants every step must keep."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from dlm_toolkit.config import ConfigError, RoleSpec, SamplingConfig
from dlm_toolkit.hooks.base import StepHook, collect
from dlm_toolkit.strategy.policy_config import PolicyConfig, load_policy
from dlm_toolkit.strategy.registry import REGISTRIES
from dlm_toolkit.strategy.selection import remaskable
from dlm_toolkit.strategy.base import (
    BlockSchedule,
    EditRule,
    RemaskRule,
    Selection,
    StepContext,
    Strategy,
    UnmaskRule,
)


FORWARDS_PER_POSITION = 64
FORWARDS_FLOOR = 4096  # the largest step count a built-in rule's Config allows (indel_steps, max_post_steps)


def forward_budget_cap(width: int) -> int:
    """The most forwards per block the engine lets any one declared budget reach, for a block
    schedule whose windows span ``width`` positions: a finite multiple of the window, whatever a
    plug-in declares."""
    return FORWARDS_PER_POSITION * width + FORWARDS_FLOOR


def check_budgets(policy: DecodingPolicy) -> None:
    """Refuse a forward budget the policy declares -- the block schedule's ``max_forwards_per_block()``
    (its post steps included) and each hook's :meth:`~dlm_toolkit.hooks.base.StepHook.forward_budget`
    (a verifier's ``max_verify_forwards``, an insert/delete rule's ``max_indel_forwards``, a plug-in
    hook's own) -- unless it is an integer in ``[0, forward_budget_cap(width)]``: the engine's NFE
    bound is built from them, so ``inf`` or ``10**9`` would let a rule that deletes every step run
    for ever.

    Raises:
        ConfigError: one line naming the rule, the method and the allowed range.
    """
    blocks = policy.blocks
    width = blocks.window_width()
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 1 << 20:
        raise ConfigError(f"blocks rule '{blocks.name}': window_width() = {width!r}: must be an integer in [1, {1 << 20}]")
    cap = forward_budget_cap(width)
    budgets = [(f"blocks rule '{blocks.name}'", "max_forwards_per_block()", blocks.max_forwards_per_block)]
    budgets += [(hook.name, hook.budget_source(policy), lambda hook=hook: hook.forward_budget(policy))
                for hook in policy.hooks]
    for who, field, declared in budgets:
        value = declared()
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= cap:
            raise ConfigError(f"{who}: {field} = {value!r}: must be an integer in [0, {cap}], the engine's bound of "
                              f"{FORWARDS_PER_POSITION} forwards per window position ({width}) + {FORWARDS_FLOOR}")


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
        # what the rules add to the step (verification, shadow block, insert/delete, plug-ins), checked
        # against the policy here: the decode loop runs these at fixed stages (dlm_toolkit.hooks)
        self.hooks: list[StepHook] = collect(self)
        check_budgets(self)

    def forward_limit(self) -> int:
        """Forwards one block may take: the block schedule's bound plus what each hook adds."""
        return self.blocks.max_forwards_per_block() + sum(h.forward_budget(self) for h in self.hooks)

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

    # -- one step ------------------------------------------------------------------------
    def step(self, ctx: StepContext, memory: dict[str, Any]) -> None:
        """Run the rules in order and fill ``ctx.commit/edit/remask``. Types and shapes are checked
        here; where each selection may lie is checked on the device by :class:`StepChecks`."""
        ctx.commit = self._run(self.m2t, ctx, memory)
        ctx.edit = self._run(self.t2t, ctx, memory)
        ctx.remask = self._run(self.remask, ctx, memory)

    @classmethod
    def _run(cls, rule: Strategy, ctx: StepContext, memory: dict[str, Any]) -> torch.Tensor:
        out = rule(ctx)
        if isinstance(out, Selection):
            memory[rule.role] = out.memory
            out = out.select
        return cls.check_selection(rule, ctx, out)

    @staticmethod
    def check_selection(rule: Strategy, ctx: StepContext, out: Any) -> torch.Tensor:
        """``out`` if it is a bool tensor shaped like the window, else a :class:`StrategyError`
        naming the rule."""
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool or out.shape != ctx.tokens.shape:
            got = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise StrategyError(
                f"{rule.role} rule '{rule.name}' must return a bool tensor of shape {tuple(ctx.tokens.shape)} "
                f"(or a Selection), got {got}"
            )
        return out


ALLOWED = {  # role -> (where its selection may lie, how to say it)
    "m2t": (lambda ctx: ctx.fillable, "fillable (masked and in the active block)"),
    "t2t": (lambda ctx: ctx.editable, "editable (written, non-prompt, in the edit window)"),
    "remask": (remaskable, "remaskable (written, in the active block, not edited now, block has masks)"),
}


class StepChecks:
    """The invariants of each step, computed on the device and read with the next host read.

    A step must keep every selection inside its role's region (:data:`ALLOWED`), commit at least
    one position in every row whose active block has a mask, remask fewer positions than it
    commits, stay within ``limit`` forwards per block, and see finite logits. Reading the flags
    right away would stall a GPU every step; the engine reads the flags of every step since its
    last read together, at its next read, and raises (naming the first failed step) before
    anything is returned.
    """

    NAMES = ("m2t", "t2t", "remask", "progress", "net", "verify", "limit", "finite")

    def __init__(self, policy: DecodingPolicy, limit: int):
        self.policy, self.limit = policy, limit
        self._steps: list[StepContext] = []
        self._flags: list[torch.Tensor] = []

    def add(self, ctx: StepContext, state: Any) -> None:
        """Compute the checks of the step just written (no host sync)."""
        assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
        has_masks = ctx.fillable.any(1)
        net = ctx.commit.sum(1) - ctx.remask.sum(1)
        verified = ctx.verified if ctx.verified is not None else torch.zeros_like(ctx.live)
        self._steps.append(ctx)
        self._flags.append(torch.stack([
            *((getattr(ctx, sel) & ~ALLOWED[role][0](ctx)).any() for role, sel in
              (("m2t", "commit"), ("t2t", "edit"), ("remask", "remask"))),
            (has_masks & ~ctx.commit.any(1)).any(),
            (has_masks & ctx.remask.any(1) & (net < 1)).any(),
            (verified & (state.block_step[ctx.rows] > self.limit)).any(),  # a verification forward past the bound
            (ctx.live & (state.block_step[ctx.rows] > self.limit)).any(),
            ~(torch.isfinite(ctx.confidence) | ~ctx.valid).all(),
        ]))

    def pending(self, device: torch.device) -> torch.Tensor:
        """The flags of the steps since the last read, one after the other (empty before the first)."""
        return torch.cat(self._flags) if self._flags else torch.zeros(0, dtype=torch.bool, device=device)

    def raise_if_failed(self, flags: list[int]) -> None:
        """Raise :class:`StrategyError` naming the rule, row and position of the first failed check
        of the steps :meth:`pending` covered, then forget them."""
        steps, n = self._steps, len(self.NAMES)
        self._steps, self._flags = [], []
        for i, ctx in enumerate(steps):
            self._raise(ctx, list(flags[i * n:(i + 1) * n]))

    def _raise(self, ctx: StepContext, flags: list[int]) -> None:
        if not any(flags):
            return
        policy = self.policy
        failed = self.NAMES[flags.index(1)]
        if failed in ALLOWED:
            rule = getattr(policy, failed)
            region, what = ALLOWED[failed]
            outside = getattr(ctx, {"m2t": "commit", "t2t": "edit", "remask": "remask"}[failed]) & ~region(ctx)
            r, w = (int(v) for v in outside.nonzero()[0])
            raise StrategyError(
                f"{rule.role} rule '{rule.name}' selected position {int(ctx.positions[r, w])} of batch row "
                f"{int(ctx.rows[r])}, which is not {what}"
            )
        if failed == "progress":
            r = int((ctx.fillable.any(1) & ~ctx.commit.any(1)).nonzero()[0, 0])
            raise StrategyError(
                f"m2t rule '{policy.m2t.name}' committed nothing in batch row {int(ctx.rows[r])} although its "
                f"active block has {int(ctx.fillable[r].sum())} masked positions (every step must make progress)"
            )
        if failed == "net":
            bad = ctx.fillable.any(1) & ctx.remask.any(1) & (ctx.commit.sum(1) - ctx.remask.sum(1) < 1)
            r = int(bad.nonzero()[0, 0])
            raise StrategyError(
                f"remask rule '{policy.remask.name}' remasked {int(ctx.remask[r].sum())} positions in batch row "
                f"{int(ctx.rows[r])} but only {int(ctx.commit[r].sum())} were committed (net progress must be >= 1)"
            )
        if failed == "verify":
            raise StrategyError(
                f"m2t rule '{policy.m2t.name}' asked for a verification forward past the bound of {self.limit} "
                f"forwards per block (block schedule '{policy.blocks.name}' plus the rule's max_verify_forwards)")
        if failed == "limit":
            raise StrategyError(f"block schedule '{policy.blocks.name}' exceeded {self.limit} forwards in one block")
        bad = (~torch.isfinite(ctx.confidence) & ctx.valid).any(1)
        r = int(bad.nonzero()[0, 0])
        raise NonFiniteLogitsError(
            f"non-finite logits from the model in forward {int(ctx.step[r]) + 1} of batch row {int(ctx.rows[r])} "
            f"(positions {ctx.positions[r][~torch.isfinite(ctx.confidence[r]) & ctx.valid[r]].tolist()[:8]}): "
            "check the weights (load_model(..., check_finite=True)) and the dtype"
        )


class NonFiniteLogitsError(StrategyError):
    """The model produced NaN or infinite logits where the rules read them."""


def _spec(rule: Strategy) -> dict[str, Any]:
    return rule.spec().model_dump()
