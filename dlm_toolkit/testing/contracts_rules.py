"""Contract suites of the three selection roles (M2T, T2T, remask): the role's invariants on many
random contexts over consecutive steps, determinism, batch invariance, seed use and device."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from dlm_toolkit.config import RoleSpec
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.strategy.selection import remaskable
from dlm_toolkit.strategy.base import ROLE_SELECTION, StepContext, Strategy
from dlm_toolkit.testing.contracts_base import _policy, _StrategyContract, on_meta_default
from dlm_toolkit.testing.contracts_cases import STEPS, _as_tensor, _commit_for, advance, build_context, random_case


class _RuleContract(_StrategyContract):
    """Checks shared by the three selection roles, on random contexts over consecutive steps."""

    uses_randomness: ClassVar[bool] = False
    n_cases: ClassVar[int] = 30

    def prepare(self, ctx: StepContext) -> None:
        """Fill what the policy decides before this role runs (``ctx.commit``, ``ctx.edit``)."""

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def store(self, ctx: StepContext, select: torch.Tensor) -> None:
        setattr(ctx, ROLE_SELECTION[self.role], select)

    def check(self, rule: Strategy, ctx: StepContext, select: torch.Tensor, where: str) -> None:
        """Role invariants for one output (type, shape, allowed positions, progress)."""
        assert select.dtype == torch.bool, f"{rule!r} {where}: selection dtype {select.dtype}, expected torch.bool"
        assert select.shape == ctx.tokens.shape, f"{rule!r} {where}: selection shape {tuple(select.shape)}, expected {tuple(ctx.tokens.shape)}"
        outside = select & ~self.allowed(ctx)
        assert not outside.any(), f"{rule!r} {where}: selected positions {outside.nonzero().tolist()} outside the allowed ones"

    def exercise(self, rule: Strategy) -> None:
        self.run_case(rule, random_case(1), 1)

    def run_case(self, rule: Strategy, case: dict[str, Any], seed: int, generator_seed: int | None = None
                 ) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
        """Run ``STEPS`` consecutive steps of one random case, memory carried, each output checked.

        Returns the case of every step (the canvas moves on with the rule's own selections) and
        the selections. The rows' random streams are seeded from ``generator_seed`` (default ``seed``).
        """
        cases, outs, memory = [case], [], {}
        gen = seed if generator_seed is None else generator_seed
        for s in range(STEPS):
            ctx = build_context(cases[-1], seed=gen + s, memory=memory)
            before = (ctx.tokens.clone(), ctx.confidence.clone(), ctx.logits.clone())
            self.prepare(ctx)
            select, mem = _as_tensor(rule, rule(ctx))
            after = (ctx.tokens, ctx.confidence, ctx.logits)
            assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{rule!r} modified the context's tensors"
            self.check(rule, ctx, select, f"(case seed {seed}, step {s})")
            memory = {**memory, rule.role: mem} if mem is not None else memory
            outs.append(select)
            self.store(ctx, select)
            for name in ("commit", "edit", "remask"):
                if getattr(ctx, name) is None:
                    setattr(ctx, name, torch.zeros_like(select))
            if s + 1 < STEPS:
                cases.append(advance(cases[-1], ctx, seed + 100 + s))
        return cases, outs

    def test_selection_contract_on_random_contexts(self):
        for rule in self.rules():
            for seed in range(self.n_cases):
                self.run_case(rule, random_case(seed), seed)

    def test_deterministic_under_seed(self):
        for rule in self.rules():
            for seed in range(0, self.n_cases, 3):
                _, a = self.run_case(rule, random_case(seed), seed)
                _, b = self.run_case(rule, random_case(seed), seed)
                assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{rule!r}: same contexts and seed, different selections"

    def test_ignores_seed_unless_random(self):
        for rule in self.rules():
            if self.is_random(rule):
                continue
            for seed in range(0, self.n_cases, 3):
                _, a = self.run_case(rule, random_case(seed), seed)
                _, b = self.run_case(rule, random_case(seed), seed, generator_seed=seed + 1000)
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (
                    f"{rule!r} depends on the random streams: set uses_randomness = True (or override is_random) in the suite"
                )

    def test_allocates_on_the_inputs_device(self):
        """The rule runs with the default device pointed at ``meta`` while its inputs are on the CPU:
        a tensor made without ``device=`` (``torch.zeros(n)``, ``torch.arange(w)``) lands on ``meta``
        and fails to mix with the inputs, as it would fail on a GPU."""
        for rule in self.rules():
            for seed in range(0, self.n_cases, 4):

                def select(meta: bool, seed: int = seed) -> tuple[torch.Tensor, StepContext]:
                    ctx = build_context(random_case(seed), seed=seed, memory={})  # inputs on the CPU
                    self.prepare(ctx)
                    with torch.device("meta") if meta else contextlib.nullcontext():
                        return _as_tensor(rule, rule(ctx))[0], ctx

                out, ctx = on_meta_default(lambda: select(True), lambda: select(False), f"{rule!r} (case seed {seed})")
                assert out.device == ctx.device, f"{rule!r} returned a selection on {out.device}, inputs are on {ctx.device}"

    def test_batch_invariance(self):
        for rule in self.rules():
            for seed in range(self.n_cases):
                cases, batch_outs = self.run_case(rule, random_case(seed), seed)
                for i in range(cases[0]["tokens"].shape[0]):
                    memory: dict[str, Any] = {}
                    for s, case in enumerate(cases):  # row i alone along the batch's trajectory
                        ctx = build_context(case, [i], seed=seed + s, memory=memory)
                        self.prepare(ctx)
                        alone, mem = _as_tensor(rule, rule(ctx))
                        memory = {**memory, rule.role: mem} if mem is not None else memory
                        assert torch.equal(batch_outs[s][i], alone[0]), (
                            f"{rule!r} (case seed {seed}, step {s}): batch row {i} selects "
                            f"{batch_outs[s][i].nonzero().flatten().tolist()}, alone {alone[0].nonzero().flatten().tolist()}"
                        )


class UnmaskRuleContract(_RuleContract):
    """Contract suite for M2T rules (:class:`~dlm_toolkit.strategy.base.UnmaskRule`).

    Checks, besides the shared ones: the commit lies inside ``ctx.fillable`` and holds at least
    one position in every row whose active block has a mask. End-to-end policy: this rule, T2T
    ``threshold`` 0.8, ``semi_ar`` blocks of 4 with 2 post steps.
    """

    role = "m2t"

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        return ctx.fillable

    def check(self, rule: Strategy, ctx: StepContext, select: torch.Tensor, where: str) -> None:
        super().check(rule, ctx, select, where)
        stalled = ctx.fillable.any(1) & ~select.any(1)
        assert not stalled.any(), f"{rule!r} {where}: no commit in rows {stalled.nonzero().flatten().tolist()} whose block has masks"

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=rule.spec(), t2t=RoleSpec(name="threshold", params={"threshold": 0.8}))


class EditRuleContract(_RuleContract):
    """Contract suite for T2T rules (:class:`~dlm_toolkit.strategy.base.EditRule`).

    Checks, besides the shared ones: the edit lies inside ``ctx.editable`` (``ctx.commit`` is
    filled first, as the policy does). End-to-end policy: M2T ``threshold`` 0.5, this rule,
    ``semi_ar`` blocks of 4 with 2 post steps.
    """

    role = "t2t"

    def prepare(self, ctx: StepContext) -> None:
        ctx.commit = _commit_for(ctx, 0.5)

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        return ctx.editable

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=RoleSpec(name="threshold", params={"threshold": 0.5}), t2t=rule.spec())


class RemaskRuleContract(_RuleContract):
    """Contract suite for remask rules (:class:`~dlm_toolkit.strategy.base.RemaskRule`).

    Checks, besides the shared ones: the remask lies inside ``remaskable(ctx)`` (written,
    non-prompt, in the active block, not edited now) in rows whose block still has masks, and leaves net progress ``commits - remasks >= 1`` per such row
    (``ctx.commit`` and ``ctx.edit`` are filled first, as the policy does). End-to-end policy:
    M2T ``threshold`` 0.3, T2T ``threshold`` 0.8, this rule, ``semi_ar`` blocks of 4.
    """

    role = "remask"

    def prepare(self, ctx: StepContext) -> None:
        ctx.commit = _commit_for(ctx, 0.3)
        ctx.edit = ctx.editable & (ctx.sampled != ctx.tokens) & (ctx.confidence > 0.8)

    def allowed(self, ctx: StepContext) -> torch.Tensor:
        return remaskable(ctx)

    def check(self, rule: Strategy, ctx: StepContext, select: torch.Tensor, where: str) -> None:
        super().check(rule, ctx, select, where)
        net = ctx.commit.sum(1) - select.sum(1)
        bad = ctx.fillable.any(1) & (net < 1)
        assert not bad.any(), f"{rule!r} {where}: rows {bad.nonzero().flatten().tolist()} remask as many as they commit"

    def policy_for(self, rule: Strategy) -> DecodingPolicy:
        return _policy(m2t=RoleSpec(name="threshold", params={"threshold": 0.3}),
                       t2t=RoleSpec(name="threshold", params={"threshold": 0.8}), remask=rule.spec())
