"""Step hooks: what a rule adds to the decode step beyond choosing positions, as one protocol.

A rule of any role asks for hooks by defining ``step_hooks(policy, role) -> Sequence[StepHook]``
(the :class:`~dlm_toolkit.hooks.verify.Verifier`, :class:`~dlm_toolkit.hooks.shadow.Shadow` and
:class:`~dlm_toolkit.hooks.indel.Indel` mixins do). A hook has two kinds of members, and each
defaults to nothing:

- **what it declares**, once: ``declare(policy)`` returns a :class:`Declaration` (the outputs it
  writes to ``ctx.hooks``, the device flags it sets, the forwards it adds per block, which hooks it
  cannot run with, when two hooks are one) and raises :class:`~dlm_toolkit.config.ConfigError` to
  refuse the policy; ``check_model(model)`` refuses a model, once per decode;
- **the stages it runs**, every step, for all rows at once:

  =================================  =============================================================
  stage                              when
  =================================  =============================================================
  ``step_segments(eng, st, live, w)``  while the step's forward is laid out: segments
                                     (:class:`~dlm_toolkit.step.segments.Segment`) appended to it,
                                     whose logits ``eng.segment_logits(self)`` gives later
  ``after_forward(ctx, eng, st)``    after the forward, before the rules (set ``ctx.hooks`` outputs)
  ``after_rules(ctx, eng, st)``      after the rules filled ``ctx.commit/edit/remask``, before the write
  ``after_write(ctx, st)``           after the canvas write, before the block schedule reacts
  =================================  =============================================================

:class:`~dlm_toolkit.decoding.policy.DecodingPolicy` collects the hooks and their declarations
once, when it is built (:func:`collect`: ``policy.hooks``, ``policy.declarations``), and the loop
runs only the stages a hook overrides (:class:`HookStages`), so a policy without hooks runs exactly
the plain step. :func:`collect` refuses, each as one ``ConfigError`` naming the hook: a method that
looks like a stage but is none (``after_forwards``, ``before_rules``: it would never run), a stage
overridden with another number of arguments, a malformed declaration, two hooks declaring one output
or one flag, and a hook that moves the block next to one that needs it fixed.

A hook that needs a forward of its own (a verification) runs it from a stage with
:meth:`StepEngine.extra_forward(segments, rows) <dlm_toolkit.decoding.engine.StepEngine.extra_forward>`,
counted as one NFE of ``rows``. Hooks hold no per-decode state (a policy is shared between decodes):
what a step needs lives on the context or the decode state. Hooks run on the device: no host reads
(errors go through device flags, :mod:`dlm_toolkit.step.flags`). A stage that raises anything but the
toolkit's own errors ends the decode with one line naming the hook and the stage.

Hooks written against the members this protocol replaced (``outputs``, ``key()``,
``device_flags()``, ``check_policy()``, ``forward_budget()``, ``budget_source()``, ``moves_block``,
``needs_fixed_block``) still run, with a ``DeprecationWarning``, until 0.3.0 (:mod:`dlm_toolkit.hooks.legacy`).
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping, Sequence

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.hooks.legacy import LEGACY, legacy_fields, legacy_members, warn_legacy
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


@dataclass(frozen=True)
class Declaration:
    """What a step hook declares when the policy is built (:meth:`StepHook.declare`).

    Attributes:
        outputs: the values the hook sets on ``ctx.hooks``: name -> :class:`~dlm_toolkit.step.outputs.Output`
            (shape over the step's ``"B"``, ``"W"``, ``"V"``, or ``()`` for a Python number; dtype).
            Setting anything else, or a value of another shape or dtype, is a ``StrategyError``.
        flags: the :class:`~dlm_toolkit.step.flags.DeviceFlag` s the hook sets on the device with
            :func:`~dlm_toolkit.step.flags.set_flag`; the engine's one host read raises them.
        forward_budget: forwards per block the hook may add to the schedule's bound (an integer in
            ``[0, 64 x window + 4096]``), and ``budget_source``, where a refusal says it comes from.
        key: hooks with equal keys are one hook (the first collected is kept), e.g. two rules reading
            one shadow block; None: this hook object alone.
        moves_block: the hook moves or resizes the active block (dynamic blocks) ...
        needs_fixed_block: ... and why this one cannot run next to such a hook ("" = it can): it
            copies the active block of ``block_length`` positions from the block's start.
    """

    outputs: Mapping[str, Output] = field(default_factory=dict)
    flags: Sequence[DeviceFlag] = ()
    forward_budget: int = 0
    budget_source: str = "declare(policy).forward_budget"
    key: Hashable = None
    moves_block: bool = False
    needs_fixed_block: str = ""


class StepHook:
    """Base of a step hook: every member a no-op (module docstring). Override what you need."""

    name = "hook"  # how messages name the hook (the default: by its class, see label())

    # -- once ------------------------------------------------------------------------------------
    def declare(self, policy: DecodingPolicy) -> Declaration:
        """What this hook writes, sets, costs and needs under ``policy`` (:class:`Declaration`);
        raise :class:`~dlm_toolkit.config.ConfigError` if the policy cannot run it."""
        return Declaration()

    def check_model(self, model: DiffusionLM) -> None:
        """Raise :class:`~dlm_toolkit.config.ConfigError` if ``model`` cannot run this hook."""

    # -- every step, in the loop's order -----------------------------------------------------------
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
        """After the rules filled ``ctx.commit/edit/remask`` (it may narrow them), before the write."""

    def after_write(self, ctx: StepContext, state: DecodeState) -> None:
        """After the step's write, before the block schedule ends converged blocks."""


label = hook_label  # how messages name a hook: its name, else (the default "hook") its class


# the members a hook may override: every public method of StepHook (ones added to it are known at once)
KNOWN = tuple(n for n, v in vars(StepHook).items() if not n.startswith("_") and callable(v))
STAGE_PREFIXES = ("after_", "before_", "check_", "on_")
# names near a stage that the prefixes miss (a typo there would silently never run)
NEAR_MISSES = ("afterforward", "afterrules", "afterwrite", "declares", "declaration", "checkmodel")
RESERVED = frozenset(n for n in dir(HookOutputs) if not n.startswith("_")) | {"writer"}


def check_hook(hook: StepHook) -> None:
    """Refuse, naming the hook: a method that looks like a stage but is none and a stage overridden
    with a signature the loop cannot call (module docstring)."""
    who = label(hook)
    for cls in type(hook).__mro__:
        if cls is StepHook or cls is object or not issubclass(cls, StepHook):
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") or name in LEGACY or not callable(getattr(hook, name, None)) \
                    or isinstance(value, type):
                continue
            if name in KNOWN:
                _check_signature(hook, who, name)
            elif (name.startswith(STAGE_PREFIXES) or name in NEAR_MISSES
                  or difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.85)):
                raise ConfigError(f"{who}: method {type(hook).__qualname__}.{name}() is not a hook member and would "
                                  f"never run (known: {', '.join(KNOWN)})")


def check_declaration(who: str, got: Any) -> Declaration:
    """``got`` if it is a well-formed :class:`Declaration`, else one ``ConfigError`` naming the hook
    and the field (the forward budget's range is checked with the policy's, by ``check_budgets``)."""
    if not isinstance(got, Declaration):
        raise ConfigError(f"{who}: declare(policy) must return a dlm_toolkit.hooks.Declaration, got {type(got).__name__}")
    if not isinstance(got.outputs, Mapping):
        raise ConfigError(f"{who}: Declaration.outputs must map output names to dlm_toolkit.strategy.Output, got "
                          f"{type(got.outputs).__name__}")
    for name, out in got.outputs.items():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_") or name in RESERVED:
            raise ConfigError(f"{who}: output name {name!r} must be a Python identifier, not starting with '_' and "
                              f"not one of {', '.join(sorted(RESERVED))}")
        problem = out.problem() if isinstance(out, Output) else f"must be an Output, got {type(out).__name__}"
        if problem is not None:
            raise ConfigError(f"{who}: output '{name}': {problem}")
    if not isinstance(got.flags, (list, tuple)) or not all(isinstance(f, DeviceFlag) for f in got.flags):
        bad = got.flags if not isinstance(got.flags, (list, tuple)) else next(
            f for f in got.flags if not isinstance(f, DeviceFlag))
        raise ConfigError(f"{who}: Declaration.flags must be a list of DeviceFlag objects, got {type(bad).__name__}")
    for attr, kind in (("budget_source", str), ("moves_block", bool), ("needs_fixed_block", str)):
        if not isinstance(getattr(got, attr), kind):
            raise ConfigError(f"{who}: Declaration.{attr} must be a {kind.__name__}, got "
                              f"{type(getattr(got, attr)).__name__}")
    try:
        hash(got.key)
    except TypeError:
        raise ConfigError(f"{who}: Declaration.key must be hashable, got {type(got.key).__name__}") from None
    return got


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


def declaration(hook: StepHook, policy: DecodingPolicy) -> Declaration:
    """``hook.declare(policy)``, checked (:func:`check_declaration`); a hook written against the
    replaced members gets its declaration from them (:mod:`dlm_toolkit.hooks.legacy`)."""
    who, old = label(hook), legacy_members(hook)
    if old and not overrides(hook, "declare"):
        warn_legacy(who, old)
        return check_declaration(who, Declaration(**run_stage(hook, "declare", legacy_fields, hook, policy)))
    if old:  # half-ported: which of the two would be meant?
        raise ConfigError(f"{who}: defines declare(policy) and the members it replaced ({', '.join(old)}): move "
                          "them into the Declaration that declare returns")
    return check_declaration(who, run_stage(hook, "declare", hook.declare, policy))


def declared_outputs(hooks: Sequence[StepHook], declarations: Sequence[Declaration]) -> dict[str, Declared]:
    """Every output the hooks declare, by name, with the declaring hook's label."""
    return {name: Declared(out, label(h)) for h, d in zip(hooks, declarations) for name, out in d.outputs.items()}


def collect(policy: DecodingPolicy) -> tuple[list[StepHook], list[Declaration]]:
    """The hooks the policy's rules ask for (role order, one per key) and their declarations, each
    checked (:func:`check_hook`, :func:`check_declaration`, one owner per output,
    :func:`check_combinations`)."""
    hooks: list[StepHook] = []
    declarations: list[Declaration] = []
    seen: set[Hashable] = set()
    for role in ROLES:
        rule = getattr(policy, role)
        ask = getattr(rule, "step_hooks", None)
        for hook in (ask(policy, role) if ask is not None else ()):
            if not isinstance(hook, StepHook):
                raise ConfigError(f"{role} rule '{getattr(rule, 'name', type(rule).__name__)}': step_hooks() must "
                                  f"return StepHook objects, got {type(hook).__name__}")
            check_hook(hook)
            declared = declaration(hook, policy)
            key = id(hook) if declared.key is None else declared.key
            if key not in seen:
                seen.add(key)
                hooks.append(hook)
                declarations.append(declared)
    owner: dict[str, StepHook] = {}
    for hook, declared in zip(hooks, declarations):
        for name in declared.outputs:
            if name in owner:
                raise ConfigError(f"{label(owner[name])} and {label(hook)} both declare the output '{name}': they "
                                  "cannot be combined in one policy")
            owner[name] = hook
    check_combinations(hooks, declarations)
    return hooks, declarations


def check_combinations(hooks: Sequence[StepHook], declarations: Sequence[Declaration]) -> None:
    """Refuse a hook that needs a fixed block layout together with one that moves the block.

    Raises:
        ConfigError: one line naming both hooks and why they cannot run together.
    """
    movers = [h for h, d in zip(hooks, declarations) if d.moves_block]
    for fixed, declared in zip(hooks, declarations):
        if declared.needs_fixed_block and movers:
            raise ConfigError(f"{label(fixed)} ({declared.needs_fixed_block}) needs a fixed block layout; "
                              f"{label(movers[0])} moves and resizes its block: use semi_ar or multi_block_edit with it")


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
    """``method(*args)`` (a member of ``hook`` run once per policy or decode: ``declare``,
    ``check_model``), an exception that is not the toolkit's own turned into one line naming the
    hook and the stage (:func:`stage_error`)."""
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
