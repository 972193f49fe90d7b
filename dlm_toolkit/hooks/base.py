"""Step hooks: what a rule adds to the decode step beyond choosing positions, as one protocol.

A rule of any role asks for hooks by defining ``step_hooks(policy, role) -> Sequence[StepHook]``
(the :class:`~dlm_toolkit.hooks.verify.Verifier`, :class:`~dlm_toolkit.hooks.shadow.Shadow` and
:class:`~dlm_toolkit.hooks.indel.Indel` mixins do). :class:`~dlm_toolkit.strategy.policy.DecodingPolicy` collects
them once, when it is built (:func:`collect`, ``policy.hooks``), and the decode loop calls them at
fixed stages without knowing which hooks it has:

=================================  ====================================================================
stage                              when
=================================  ====================================================================
``check_policy(policy)``           once, when the policy is built (refuse combinations: ConfigError)
``check_model(model)``             once per decode, before anything runs (refuse a model)
``forward_budget(policy)``         forwards one block may take beyond the schedule's bound
``engine_options()``               flags the :class:`~dlm_toolkit.step.engine.StepEngine` is built with
``after_forward(ctx, eng, state)`` after the step's forward, before the rules (fill ``ctx`` fields)
``after_rules(ctx, eng, state)``   after the rules chose ``commit/edit/remask``, before the write
``after_write(ctx, state)``        after the canvas write, before the block schedule reacts
=================================  ====================================================================

Every stage defaults to nothing; the loop calls only the stages a hook overrides (:class:`HookStages`),
so a policy without hooks runs exactly the plain step. Hooks hold no per-decode state (a policy
is shared between decodes); whatever a step needs lives on the context or the decode state. Hooks
run on the device: no host reads (errors go through the step's checks or the engine's one read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

from dlm_toolkit.config import ConfigError

if TYPE_CHECKING:
    from dlm_toolkit.step.engine import StepEngine
    from dlm_toolkit.models.base import DiffusionLM
    from dlm_toolkit.strategy.policy import DecodingPolicy
    from dlm_toolkit.step.state import DecodeState
    from dlm_toolkit.strategy.base import StepContext

ROLES = ("m2t", "t2t", "remask", "blocks")  # the order hooks are collected (and checked) in
STAGES = ("after_forward", "after_rules", "after_write")  # the per-step stages, in the loop's order


class StepHook:
    """Base of a step hook: every stage a no-op (module docstring). Override the stages you need."""

    name = "hook"  # how messages name the hook

    def key(self) -> Hashable:
        """Hooks with equal keys are one hook (the first collected is kept): e.g. two rules that read
        the same shadow block need it once. Default: every hook object is its own."""
        return id(self)

    def check_policy(self, policy: DecodingPolicy) -> None:
        """Raise :class:`~dlm_toolkit.config.ConfigError` if the policy cannot run this hook."""

    def check_model(self, model: DiffusionLM) -> None:
        """Raise :class:`~dlm_toolkit.config.ConfigError` if ``model`` cannot run this hook."""

    def forward_budget(self, policy: DecodingPolicy) -> int:
        """Forwards per block this hook may add to the schedule's bound (checked on the device)."""
        return 0

    def budget_source(self, policy: DecodingPolicy) -> str:
        """Where :meth:`forward_budget` comes from, as a refusal of an absurd budget names it (the
        declaring rule's method, e.g. ``max_indel_forwards(32)``)."""
        return "forward_budget()"

    def engine_options(self) -> dict[str, Any]:
        """Keyword flags for the step engine (e.g. ``{"shadow": True}``)."""
        return {}

    def after_forward(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        """After the step's forward, before the rules."""

    def after_rules(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        """After the rules filled ``ctx.commit/edit/remask``, before the write."""

    def after_write(self, ctx: StepContext, state: DecodeState) -> None:
        """After the step's write, before the block schedule ends converged blocks."""


def collect(policy: DecodingPolicy) -> list[StepHook]:
    """The hooks the policy's rules ask for (role order, one per key), each checked against the policy."""
    hooks: list[StepHook] = []
    seen: set[Hashable] = set()
    for role in ROLES:
        rule = getattr(policy, role)
        ask = getattr(rule, "step_hooks", None)
        for hook in (ask(policy, role) if ask is not None else ()):
            if not isinstance(hook, StepHook):
                raise ConfigError(f"{role} rule '{getattr(rule, 'name', type(rule).__name__)}': step_hooks() must "
                                f"return StepHook objects, got {type(hook).__name__}")
            if hook.key() not in seen:
                seen.add(hook.key())
                hooks.append(hook)
    for hook in hooks:
        hook.check_policy(policy)
    return hooks


class HookStages:
    """The per-step stages of a list of hooks, each holding only the hooks that override it (so an
    empty stage costs one loop over an empty list)."""

    def __init__(self, hooks: Sequence[StepHook]):
        def overriding(stage: str) -> list[Callable[..., None]]:
            return [getattr(h, stage) for h in hooks if getattr(type(h), stage) is not getattr(StepHook, stage)]

        self.after_forward = overriding("after_forward")
        self.after_rules = overriding("after_rules")
        self.after_write = overriding("after_write")
        self.engine_options: dict[str, Any] = {}
        for h in hooks:
            self.engine_options.update(h.engine_options())
