"""A decoding policy: four roles composed, sampling, and the invariants every step must keep."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from dlm_toolkit.config import ConfigError, RoleSpec, SamplingConfig
from dlm_toolkit.step.flags import DeviceFlag, FlagHit, FlagTable, NonFiniteLogitsError, StrategyError, board, declare
from dlm_toolkit.hooks.base import Declaration, StepHook, collect, declared_outputs, overrides
from dlm_toolkit.strategy.policy_config import PolicyConfig, load_policy
from dlm_toolkit.strategy.registry import REGISTRIES
from dlm_toolkit.strategy.selection import remaskable
from dlm_toolkit.strategy.base import (
    BlockSchedule,
    EditRule,
    RemaskRule,
    Selection,
    ROLE_SELECTION,
    StepContext,
    Strategy,
    UnmaskRule,
    hook_label,
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
    (its post steps included) and each hook's declared ``forward_budget`` (:class:`~dlm_toolkit.hooks.base.Declaration`:
    a verifier's ``max_verify_forwards``, an insert/delete rule's ``max_indel_forwards``, a plug-in
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
    budgets = [(f"blocks rule '{blocks.name}'", "max_forwards_per_block()", blocks.max_forwards_per_block())]
    budgets += [(hook_label(hook), declared.budget_source, declared.forward_budget)
                for hook, declared in zip(policy.hooks, policy.declarations)]
    for who, field, value in budgets:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= cap:
            raise ConfigError(f"{who}: {field} = {value!r}: must be an integer in [0, {cap}], the engine's bound of "
                              f"{FORWARDS_PER_POSITION} forwards per window position ({width}) + {FORWARDS_FLOOR}")


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
        hooks, declarations = collect(self)
        self.hooks: tuple[StepHook, ...] = tuple(hooks)
        self.declarations: tuple[Declaration, ...] = tuple(declarations)  # what each hook declared, in order
        self.hook_outputs = declared_outputs(hooks, declarations)  # what ctx.hooks holds (step.outputs.HookOutputs)
        # the device flags a decode may raise (dlm_toolkit.step.flags)
        self.flags = FlagTable([(hook_label(h), f) for h, d in zip(hooks, declarations) for f in d.flags])
        check_budgets(self)

    def forward_limit(self) -> int:
        """Forwards one block may take: the block schedule's bound plus what each hook adds."""
        return self.blocks.max_forwards_per_block() + sum(d.forward_budget for d in self.declarations)

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


GUARANTEES = {  # what a rule may declare its selections always satisfy (its class's GUARANTEES)
    "inside": "every selected position lies in the role's region (ALLOWED)",
    "progress": "(m2t) a commit in every row whose active block has a mask, for confidences that are "
                "probabilities or NaN (as sampling gives them)",
    "nothing": "no position is ever selected",
}


def guaranteed(rule: Strategy) -> frozenset[str]:
    """The :data:`GUARANTEES` ``rule`` declares: the ``GUARANTEES`` attribute of the class that defines
    its ``__call__`` (a subclass that overrides ``__call__`` and declares nothing has none). Built-in
    rules declare them next to their ``__call__``; ``tests/test_step_guarantees.py`` checks each
    declaration against random contexts."""
    for klass in type(rule).__mro__:
        if "__call__" in vars(klass):
            return frozenset(vars(klass).get("GUARANTEES", ())) & GUARANTEES.keys()
    return frozenset()


def provably_kept(policy: DecodingPolicy) -> frozenset[str]:
    """The step checks (:attr:`StepChecks.NAMES`) the policy's rules cannot fail by their
    :func:`guaranteed` declarations: none when the policy has step hooks (a hook may replace a
    selection after the rules, or change the context they read)."""
    if policy.hooks:
        return frozenset()
    m2t, t2t, remask = guaranteed(policy.m2t), guaranteed(policy.t2t), guaranteed(policy.remask)
    kept = {"m2t"} if m2t & {"inside", "nothing"} else set()
    kept |= {"progress"} if "progress" in m2t else set()
    kept |= {"t2t"} if t2t & {"inside", "nothing"} else set()
    kept |= {"remask", "net"} if "nothing" in remask else {"remask"} if "inside" in remask else set()
    return frozenset(kept)


class StepChecks:
    """The invariants of each step, computed on the device and raised at the next host read.

    A step must keep every selection inside its role's region (:data:`ALLOWED`), commit at least
    one position in every row whose active block has a mask, remask fewer positions than it
    commits, stay within ``limit`` forwards per block, and see finite logits. Each check is a
    device flag (:data:`CHECKS`, :mod:`dlm_toolkit.step.flags`) set per row every step; reading them
    right away would stall a GPU every step, so the engine's next read carries them, and the
    first failed step (then check, then row) raises before anything is returned. The messages
    read that step's context, which is kept here until the read. Checks the policy's rules
    provably keep (:func:`provably_kept`) are not computed.
    """

    NAMES = ("m2t", "t2t", "remask", "progress", "net", "verify", "limit", "finite")

    def __init__(self, policy: DecodingPolicy, limit: int):
        self.policy, self.limit = policy, limit
        self._steps: dict[int, StepContext] = {}  # board step -> its context, since the last read
        # a policy without a verifying hook never has ctx.verified: its verify flag can never be set,
        # so it is left out of the step's flags (decided here, once, not per step), as are the checks
        # its rules keep by their declared guarantees
        self.verify = "verified" in policy.hook_outputs
        self.proven = provably_kept(policy)
        # the policy's remask rule never selects and no hook replaces its selection (the write may skip remasks)
        self.no_remask = "net" in self.proven
        self.flags = tuple(f for f in CHECKS if f.name not in self.proven and (self.verify or f.name != "verify"))
        self.names = frozenset(f.name for f in self.flags)

    def add(self, ctx: StepContext, state: Any) -> None:
        """Set the checks of the step just written (no host sync).

        Fused forms (each pinned against the plain formula in ``tests/test_step_fast_paths.py``):
        ``sel > region`` is ``sel & ~region`` on bools; "net < 1 where something was remasked" is
        ``remasks >= max(commits, 1)``; a non-finite confidence at a real slot is ``valid > (z == z)`` with
        ``z = confidence - confidence`` (0 for every finite value, NaN for inf and NaN): one aten op more
        than ``isfinite`` by the dispatch count, but ``isfinite`` alone costs about what sub + eq + gt + any
        do (3.3 us against 0.8 us an op on a (1, 32) window, one CPU thread)."""
        assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
        names = self.names
        every = ctx.rows is state.all_rows
        over = (state.block_step if every else state.block_step[ctx.rows]) > self.limit
        cols = []  # one column per flag of self.flags, in CHECKS' order
        if "m2t" in names:
            cols.append((ctx.commit > ctx.fillable).any(1))
        if "t2t" in names:
            cols.append((ctx.edit > ctx.editable).any(1))
        if "remask" in names:
            cols.append((ctx.remask > remaskable(ctx)).any(1))
        if "progress" in names or "net" in names:
            has_masks, n_commit = ctx.fillable.any(1), ctx.commit.sum(1)
            if "progress" in names:
                cols.append(has_masks & (n_commit == 0))
            if "net" in names:
                cols.append(has_masks & (ctx.remask.sum(1) >= n_commit.clamp(min=1)))
        if self.verify:  # a verification forward past the bound
            cols.append((ctx.verified if ctx.verified is not None else torch.zeros_like(ctx.live)) & over)
        zero = ctx.confidence - ctx.confidence  # NaN exactly where the confidence is not finite
        cols += [ctx.live & over, (ctx.valid > (zero == zero)).any(1)]
        hits = torch.stack(cols, 1)
        flags = board(state)
        if ctx.rows.shape[0] != flags.rows:  # a context of some rows: their checks in their batch rows
            hits = hits.new_zeros(flags.rows, len(self.flags)).index_copy_(0, ctx.rows, hits)
        self._steps[flags.step] = ctx
        flags.set_many(self.flags, hits, source=self)
        flags.step += 1

    def forget(self) -> None:
        """Drop the contexts of the steps a read covered (it found no failed check)."""
        self._steps.clear()

    def context(self, step: int) -> StepContext:
        """The context of board step ``step`` (for the messages)."""
        return self._steps[step]


def _ctx_row(hit: FlagHit) -> tuple[StepChecks, StepContext, int]:
    checks: StepChecks = hit.source
    ctx = checks.context(hit.step)
    r = int((ctx.rows == hit.row).nonzero()[0, 0])
    return checks, ctx, r


def _outside(role: str) -> Any:
    def message(hit: FlagHit) -> str:
        checks, ctx, r = _ctx_row(hit)
        rule = getattr(checks.policy, role)
        region, what = ALLOWED[role]
        outside = getattr(ctx, ROLE_SELECTION[role])[r] & ~region(ctx)[r]
        w = int(outside.nonzero()[0, 0])
        who = ctx.selected_by(ROLE_SELECTION[role], r, w) or f"{rule.role} rule '{rule.name}'"  # a hook that put it there
        return (f"{who} selected position {int(ctx.positions[r, w])} of batch row "
                f"{hit.row}, which is not {what}")
    return message


def _progress(hit: FlagHit) -> str:
    checks, ctx, r = _ctx_row(hit)
    return (f"m2t rule '{checks.policy.m2t.name}' committed nothing in batch row {hit.row} although its "
            f"active block has {int(ctx.fillable[r].sum())} masked positions (every step must make progress)")


def _net(hit: FlagHit) -> str:
    checks, ctx, r = _ctx_row(hit)
    return (f"remask rule '{checks.policy.remask.name}' remasked {int(ctx.remask[r].sum())} positions in batch row "
            f"{hit.row} but only {int(ctx.commit[r].sum())} were committed (net progress must be >= 1)")


def _verify(hit: FlagHit) -> str:
    checks: StepChecks = hit.source
    policy = checks.policy
    return (f"m2t rule '{policy.m2t.name}' asked for a verification forward past the bound of {checks.limit} "
            f"forwards per block (block schedule '{policy.blocks.name}' plus the rule's max_verify_forwards)")


def _limit(hit: FlagHit) -> str:
    checks: StepChecks = hit.source
    return f"block schedule '{checks.policy.blocks.name}' exceeded {checks.limit} forwards in one block"


def _finite(hit: FlagHit) -> str:
    checks, ctx, r = _ctx_row(hit)
    where = (f"in forward {int(ctx.step[r]) + 1} of batch row {hit.row} "
             f"(positions {ctx.positions[r][~torch.isfinite(ctx.confidence[r]) & ctx.valid[r]].tolist()[:8]})")
    # a hook that ran on the step's context before the rules may have put them there, not the model
    hooks = [hook_label(h) for h in checks.policy.hooks if overrides(h, "after_forward") or overrides(h, "after_rules")]
    if hooks:
        return (f"non-finite logits or confidences {where}, after {', '.join(hooks)} ran on the step's context "
                "(after_forward / after_rules): check that hook first, then the weights (load_model(..., "
                "check_finite=True)) and the dtype")
    return (f"non-finite logits from the model {where}: check the weights (load_model(..., check_finite=True)) "
            "and the dtype")


CHECKS = (  # StepChecks.NAMES as device flags, in that order
    DeviceFlag("m2t", _outside("m2t")),
    DeviceFlag("t2t", _outside("t2t")),
    DeviceFlag("remask", _outside("remask")),
    DeviceFlag("progress", _progress),
    DeviceFlag("net", _net),
    DeviceFlag("verify", _verify),
    DeviceFlag("limit", _limit),
    DeviceFlag("finite", _finite, NonFiniteLogitsError),
)
declare("the step checks", CHECKS)


def _spec(rule: Strategy) -> dict[str, Any]:
    return rule.spec().model_dump()
