"""Step hooks: what a rule adds to the decode step beyond choosing positions, as one protocol.

A rule of any role asks for hooks by defining ``step_hooks(policy, role) -> Sequence[StepHook]``
(the :class:`~dlm_toolkit.hooks.verify.Verifier`, :class:`~dlm_toolkit.hooks.shadow.Shadow` and
:class:`~dlm_toolkit.hooks.indel.Indel` mixins do). :class:`~dlm_toolkit.decoding.policy.DecodingPolicy` collects
them once, when it is built (:func:`collect`, ``policy.hooks``), and the decode loop calls them at
fixed stages without knowing which hooks it has:

=================================  ====================================================================
stage                              when
=================================  ====================================================================
``check_policy(policy)``           once, when the policy is built (refuse combinations: ConfigError)
``check_model(model)``             once per decode, before anything runs (refuse a model)
``forward_budget(policy)``         forwards one block may take beyond the schedule's bound
``step_segments(...)``             ``(eng, state, live, window)``, while the step's forward is laid out:
                                   segments (:class:`~dlm_toolkit.step.segments.Segment`) to append to it;
                                   their logits are ``eng.segment_logits(self)`` from ``after_forward`` on
``after_forward(ctx, eng, state)`` after the step's forward, before the rules (set its ``ctx.hooks`` outputs)
``after_rules(ctx, eng, state)``   after the rules chose ``commit/edit/remask``, before the write
``after_write(ctx, state)``        after the canvas write, before the block schedule reacts
``device_flags()``                 once, when the policy is built: the hook's
                                   :class:`~dlm_toolkit.step.flags.DeviceFlag` s (errors it sets on the
                                   device with :func:`~dlm_toolkit.step.flags.set_flag`; the engine's one
                                   read raises them)
=================================  ====================================================================

A hook declares the outputs it writes to the context in :attr:`StepHook.outputs` (name ->
:class:`~dlm_toolkit.strategy.base.Output`: shape over the step and dtype); the context carries them in
one namespace, ``ctx.hooks`` (:class:`~dlm_toolkit.strategy.base.HookOutputs`), which refuses anything
else, naming the hook. When the policy is built, :func:`collect` refuses a hook method that looks like
a stage but is none (``after_forwards``, ``before_rules``, ``check_policies``: it would never run), a
stage overridden with another number of arguments, a malformed declaration, and two hooks declaring
one output, each as one :class:`~dlm_toolkit.config.ConfigError` naming the hook. A hook that replaces
``ctx.commit/edit/remask`` is recorded (:class:`HookStages`), so a step check that finds a selection
outside its role's region names the hook that put the position there, not the rule.

A hook that needs a forward of its own (a verification) runs it from a stage with
:meth:`StepEngine.extra_forward(segments, rows) <dlm_toolkit.decoding.engine.StepEngine.extra_forward>`,
counted as one NFE of ``rows``; the engine lays it out, runs and counts it like the step's own.

Two declared properties say which hooks cannot run together: ``moves_block`` (the hook moves or
resizes the active block, e.g. dynamic blocks) and ``needs_fixed_block`` (a non-empty reason: the
hook copies the active block of ``block_length`` positions from the block's start, e.g. the
verification forward and the shadow block). :func:`collect` refuses such a pair when the policy is
built, with one ConfigError naming both hooks.

Every stage defaults to nothing; the loop calls only the stages a hook overrides (:class:`HookStages`),
so a policy without hooks runs exactly the plain step. Hooks hold no per-decode state (a policy
is shared between decodes); whatever a step needs lives on the context or the decode state. Hooks
run on the device: no host reads (errors go through the step's checks or the engine's one read).
"""

from __future__ import annotations

import difflib
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Hashable, Mapping, Sequence

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.step.flags import DeviceFlag, StrategyError
from dlm_toolkit.step.outputs import Declared, HookOutputs, Output, hook_label

if TYPE_CHECKING:
    from dlm_toolkit.decoding.engine import StepEngine
    from dlm_toolkit.models.base import DiffusionLM
    from dlm_toolkit.decoding.policy import DecodingPolicy
    from dlm_toolkit.step.segments import Segment
    from dlm_toolkit.step.state import DecodeState
    from dlm_toolkit.strategy.base import StepContext

ROLES = ("m2t", "t2t", "remask", "blocks")  # the order hooks are collected (and checked) in
STAGES = ("after_forward", "after_rules", "after_write")  # the per-step stages, in the loop's order


class StepHook:
    """Base of a step hook: every stage a no-op (module docstring). Override the stages you need."""

    name = "hook"  # how messages name the hook (the default: by its class, see label())
    # the outputs the hook sets on ctx.hooks: name -> shape over the step and dtype (module docstring)
    outputs: ClassVar[Mapping[str, Output]] = {}

    def key(self) -> Hashable:
        """Hooks with equal keys are one hook (the first collected is kept): e.g. two rules that read
        the same shadow block need it once. Default: every hook object is its own."""
        return id(self)

    moves_block = False  # this hook moves or resizes the active block (refused with needs_fixed_block)
    needs_fixed_block = ""  # why this hook needs the fixed block layout ("" = it does not)

    def device_flags(self) -> Sequence[DeviceFlag]:
        """The device flags this hook sets (:mod:`dlm_toolkit.step.flags`): declared here, so the policy's
        table holds them and the engine's one host read raises them."""
        return ()

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

    def step_segments(self, engine: StepEngine, state: DecodeState, live: torch.Tensor,
                      window: Segment) -> Sequence[Segment]:
        """Segments to append to every step forward (after ``window``, the step's primary segment;
        ``live`` (N,) bool the rows that forward). Their logits, in order, are
        ``engine.segment_logits(self)`` in the later stages of the step. They add ``forward_tokens``
        (their real slots), never an NFE."""
        return ()

    def after_forward(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        """After the step's forward, before the rules."""

    def after_rules(self, ctx: StepContext, engine: StepEngine, state: DecodeState) -> None:
        """After the rules filled ``ctx.commit/edit/remask``, before the write."""

    def after_write(self, ctx: StepContext, state: DecodeState) -> None:
        """After the step's write, before the block schedule ends converged blocks."""


label = hook_label  # how messages name a hook: its name, else (the default "hook") its class


# the stages a hook may override: every public method of StepHook (stages added to it are known at once)
KNOWN = tuple(n for n, v in vars(StepHook).items() if not n.startswith("_") and callable(v))
STAGE_PREFIXES = ("after_", "before_", "check_", "on_")
# names near a stage that the prefixes miss (a typo there would silently never run)
NEAR_MISSES = ("afterforward", "afterrules", "afterwrite", "forward_budgets", "engine_option", "budget_sources",
               "checkpolicy", "checkmodel")
RESERVED = frozenset(n for n in dir(HookOutputs) if not n.startswith("_")) | {"writer"}


def check_hook(hook: StepHook) -> None:
    """Refuse, naming the hook: a method that looks like a stage but is none, a stage overridden with a
    signature the loop cannot call, and a malformed ``outputs`` declaration (module docstring)."""
    who = label(hook)
    for cls in type(hook).__mro__:
        if cls is StepHook or cls is object or not issubclass(cls, StepHook):
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") or not callable(getattr(hook, name, None)) or isinstance(value, type):
                continue
            if name in KNOWN:
                _check_signature(hook, who, name)
            elif (name.startswith(STAGE_PREFIXES) or name in NEAR_MISSES
                  or difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.85)):
                raise ConfigError(f"{who}: method {type(hook).__qualname__}.{name}() is not a hook stage and would "
                                  f"never run (known stages: {', '.join(KNOWN)})")
    outputs = hook.outputs
    if not isinstance(outputs, Mapping):
        raise ConfigError(f"{who}: outputs must map output names to dlm_toolkit.strategy.base.Output, got "
                          f"{type(outputs).__name__}")
    for name, out in outputs.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_") or name in RESERVED:
            raise ConfigError(f"{who}: output name {name!r} must be a Python identifier, not starting with '_' and "
                              f"not one of {', '.join(sorted(RESERVED))}")
        problem = out.problem() if isinstance(out, Output) else f"must be an Output, got {type(out).__name__}"
        if problem is not None:
            raise ConfigError(f"{who}: output '{name}': {problem}")


def _check_signature(hook: StepHook, who: str, stage: str) -> None:
    base = [p for p in inspect.signature(getattr(StepHook, stage)).parameters.values()][1:]  # without self
    try:
        sig = inspect.signature(getattr(hook, stage))
    except (TypeError, ValueError):  # a builtin or a callable object without a signature: trust it
        return
    try:
        sig.bind(*[None] * len(base))
    except TypeError:
        want = ", ".join(p.name for p in base)
        raise ConfigError(f"{who}: stage {type(hook).__qualname__}.{stage}{sig} cannot be called as "
                          f"{stage}({want}) (the loop passes {len(base)} argument{'s' if len(base) != 1 else ''})"
                          ) from None


def declared_outputs(hooks: Sequence[StepHook]) -> dict[str, Declared]:
    """Every output the hooks declare, by name, with the declaring hook's label."""
    return {name: Declared(out, label(h)) for h in hooks for name, out in h.outputs.items()}


def collect(policy: DecodingPolicy) -> list[StepHook]:
    """The hooks the policy's rules ask for (role order, one per key), each checked (:func:`check_hook`,
    one owner per output) and then checked against the policy."""
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
    owner: dict[str, StepHook] = {}
    for hook in hooks:
        check_hook(hook)
        for name in hook.outputs:
            if name in owner:
                raise ConfigError(f"{label(owner[name])} and {label(hook)} both declare the output '{name}': they "
                                  "cannot be combined in one policy")
            owner[name] = hook
    check_combinations(hooks)
    for hook in hooks:
        run_stage(hook, "check_policy", hook.check_policy, policy)
    return hooks


# exceptions a stage raises that pass unchanged: the toolkit's own (they name their source already) and
# assertion failures (the contract suites fail a test from inside a stage)
PASS_THROUGH = (ConfigError, StrategyError, AssertionError)


def stage_error(who: str, stage: str, err: BaseException, kind: type[Exception] = StrategyError) -> Exception:
    """One line naming the hook, its stage and what went wrong, for an exception a hook's stage raised
    that is none of the toolkit's own (those name their source already); raise it ``from err`` so the
    original stays chained for ``--debug`` and the API."""
    text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    if isinstance(err, MemoryError) or "can't allocate memory" in text or "not enough memory" in text \
            or "out of memory" in text.lower():
        what = f"ran out of memory ({text or type(err).__name__})"
    else:
        what = f"raised {type(err).__name__}" + (f": {text}" if text else "")
    return kind(f"{who}: {stage} {what}")


def run_stage(hook: StepHook, stage: str, method: Callable[..., Any], *args: Any,
              kind: type[Exception] = ConfigError) -> Any:
    """``method(*args)`` (a stage of ``hook`` run once per policy or decode: ``check_policy``,
    ``check_model``, ``forward_budget``), an exception that is not the toolkit's own turned into one
    line naming the hook and the stage (:func:`stage_error`)."""
    try:
        return method(*args)
    except PASS_THROUGH:
        raise
    except Exception as err:
        raise stage_error(label(hook), stage, err, kind) from err


SELECTIONS = ("commit", "edit", "remask")


def _as_writer(hook: StepHook, stage: str) -> Callable[..., None]:
    """``hook.<stage>`` run as the context's current writer: its ``ctx.hooks`` writes are its own, and
    each selection it replaces is recorded with the selection before it (``ctx.replaced``)."""
    method, who = getattr(hook, stage), label(hook)

    def run(ctx: StepContext, *args: Any) -> None:
        before = [getattr(ctx, sel) for sel in SELECTIONS]
        ctx.hooks.writer = who
        try:
            method(ctx, *args)
        except PASS_THROUGH:
            raise
        except Exception as err:  # a plug-in's bug: one line naming it, the original chained
            raise stage_error(who, stage, err) from err
        finally:
            ctx.hooks.writer = None
        for sel, old in zip(SELECTIONS, before):
            new = getattr(ctx, sel)
            if old is not None and new is not old:  # identity only: no host read
                if not isinstance(new, torch.Tensor) or new.dtype != torch.bool or new.shape != old.shape:
                    got = (f"a {new.dtype} tensor of shape {tuple(new.shape)}" if isinstance(new, torch.Tensor)
                           else type(new).__name__)
                    raise StrategyError(f"{who}: {stage} set ctx.{sel} to {got}; it must stay a torch.bool tensor "
                                        f"of shape {tuple(old.shape)} (B, W)")
                if stage == "after_write":  # the canvas and the counters already hold the old selection
                    raise StrategyError(f"{who} replaced ctx.{sel} in after_write, after the step wrote it (the canvas "
                                        "and the counters hold the rules' selection): change selections in after_rules")
                ctx.replaced.append((who, sel, old))

    run.__qualname__ = f"{type(hook).__qualname__}.{stage}"
    return run


def _guarded(hook: StepHook, stage: str) -> Callable[..., Any]:
    """``hook.<stage>`` with an exception that is not the toolkit's own turned into one line naming
    the hook and the stage (:func:`stage_error`)."""
    method, who = getattr(hook, stage), label(hook)

    def run(*args: Any) -> Any:
        try:
            return method(*args)
        except PASS_THROUGH:
            raise
        except Exception as err:
            raise stage_error(who, stage, err) from err

    return run


def check_combinations(hooks: Sequence[StepHook]) -> None:
    """Refuse a hook that needs a fixed block layout together with one that moves the block.

    Raises:
        ConfigError: one line naming both hooks and why they cannot run together.
    """
    movers = [h for h in hooks if h.moves_block]
    for fixed in hooks:
        if fixed.needs_fixed_block and movers:
            mover = movers[0]
            raise ConfigError(f"{label(fixed)} ({fixed.needs_fixed_block}) needs a fixed block layout; {label(mover)} "
                              "moves and resizes its block: use semi_ar or multi_block_edit with it")


def overrides(hook: StepHook, stage: str) -> bool:
    """Whether ``hook``'s class overrides ``stage`` (the loop runs only the stages a hook overrides)."""
    return getattr(type(hook), stage) is not getattr(StepHook, stage)


class HookStages:
    """The per-step stages of a list of hooks, each holding only the hooks that override it (so an
    empty stage costs one loop over an empty list), each run as the context's writer (:func:`_as_writer`)."""

    def __init__(self, hooks: Sequence[StepHook]):
        def overriding(stage: str) -> list[Callable[..., None]]:
            return [_as_writer(h, stage) for h in hooks if overrides(h, stage)]

        self.step_segments = [(h, _guarded(h, "step_segments")) for h in hooks if overrides(h, "step_segments")]
        self.after_forward = overriding("after_forward")
        self.after_rules = overriding("after_rules")
        self.after_write = overriding("after_write")
