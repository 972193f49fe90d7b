"""What step hooks write to a step's context: an output's declaration (:class:`Output`, as a hook's
``outputs`` declares it), the declarations of a policy (:class:`Declared`) and the one namespace that
holds the outputs of one step and checks every write against them (:class:`HookOutputs`, ``ctx.hooks``).

Shared by the context (:mod:`dlm_toolkit.step.context`), the hook protocol (:mod:`dlm_toolkit.hooks.base`)
and the policy; it imports none of them, so it sits in the step's leaf package.
``dlm_toolkit.strategy.outputs`` and ``dlm_toolkit.strategy.base`` re-export every name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from dlm_toolkit.step.flags import StrategyError


DIMS = {"B": "rows of the step", "W": "window slots", "V": "vocabulary"}
SCALARS = (float, int, bool)  # the dtypes of a shape-() output: a Python number (a constant of a captured rule)


@dataclass(frozen=True)
class Output:
    """The declaration of one step-hook output (the ``outputs`` of a hook's :class:`~dlm_toolkit.hooks.base.Declaration`).

    ``shape``: dimensions over the step, each ``"B"`` (rows), ``"W"`` (window slots) or ``"V"``
    (vocabulary); ``()`` for a Python number. ``dtype``: a ``torch.dtype``; ``"logits"`` for the dtype
    of the step's logits (the model's); ``float``, ``int`` or ``bool`` for a shape-``()`` number.
    """

    shape: tuple[str, ...]
    dtype: torch.dtype | type | str
    doc: str = ""

    def problem(self) -> str | None:
        """Why this declaration is malformed (None if it is fine)."""
        if not isinstance(self.shape, tuple) or any(d not in DIMS for d in self.shape):
            return f"shape must be a tuple of {', '.join(map(repr, DIMS))} (got {self.shape!r})"
        if self.shape == ():
            return None if self.dtype in SCALARS else f"a shape-() output's dtype must be float, int or bool (got {self.dtype!r})"
        if not (isinstance(self.dtype, torch.dtype) or self.dtype == "logits"):
            return f"dtype must be a torch.dtype or 'logits' (got {self.dtype!r})"
        return None

    def describe(self, window: tuple[int, ...], vocab: int, logits_dtype: torch.dtype | None) -> str:
        """The expected value in words, with the step's sizes (e.g. ``a (2, 8) torch.bool tensor (B, W)``)."""
        if self.shape == ():
            return f"a Python {self.dtype.__name__}"  # type: ignore[union-attr]
        sizes = {"B": window[0], "W": window[1], "V": vocab}
        dtype = logits_dtype if self.dtype == "logits" else self.dtype
        return f"a {tuple(sizes[d] for d in self.shape)} {dtype} tensor ({', '.join(self.shape)})"


@dataclass(frozen=True)
class Declared:
    """An output as a policy declares it: the declaration and the hook that declares it."""

    output: Output
    hook: str


class HookOutputs:
    """The step hooks' outputs of one step (``ctx.hooks``): one attribute per output a hook of the
    policy declares; None until a hook sets it this step.

    A hook sets its outputs as attributes (``ctx.hooks.verified = rows``) or with :meth:`set`. Each
    write is checked against the declaration on metadata only (no host read): an undeclared name,
    another hook's output, a wrong shape or dtype is a :class:`StrategyError` naming the hook, the
    output, what was declared and what came. Reading a name no hook declares is an error naming the
    declared ones (a typo in a rule is not a silent None).
    """

    __slots__ = ("_declared", "_values", "_window", "_vocab", "_logits_dtype", "writer")

    def __init__(self, declared: Mapping[str, Declared] | None = None, window: tuple[int, ...] = (0, 0),
                 vocab: int = 0, logits_dtype: torch.dtype | None = None):
        object.__setattr__(self, "_declared", dict(declared or {}))
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_window", tuple(window))
        object.__setattr__(self, "_vocab", int(vocab))
        object.__setattr__(self, "_logits_dtype", logits_dtype)
        object.__setattr__(self, "writer", None)  # the hook whose stage runs now (dlm_toolkit.hooks.base.HookStages)

    @property
    def declared(self) -> Mapping[str, Declared]:
        """Every output the policy's hooks declare, by name."""
        return self._declared

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.read(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "writer":
            object.__setattr__(self, name, value)
            return
        self.set(self.writer, name, value)

    def read(self, name: str) -> Any:
        """The output ``name`` this step (None while unset); :class:`StrategyError` if no hook declares it."""
        if name in self._values:
            return self._values[name]
        if name in self._declared:
            return None
        have = ", ".join(f"{n} ({d.hook})" for n, d in self._declared.items()) or "none"
        raise StrategyError(f"ctx.hooks.{name}: no step hook of this policy declares an output '{name}' "
                            f"(declared outputs: {have})")

    def get(self, name: str) -> Any:
        """The output ``name`` if set this step, else None (also where nothing declares it)."""
        return self._values.get(name)

    def names(self) -> tuple[str, ...]:
        """The outputs set so far this step, in the order they were set."""
        return tuple(self._values)

    def set(self, hook: Any, name: str, value: Any) -> None:
        """Set output ``name`` as ``hook`` (a :class:`~dlm_toolkit.hooks.base.StepHook` or its name; None:
        whichever hook declares it), checked against the declaration (class docstring)."""
        declared = self._declared.get(name)
        who = hook if isinstance(hook, str) else hook_label(hook) if hook is not None else declared.hook if declared else None
        label = who if who is not None else "a step hook"
        if declared is None:
            own = [n for n, d in self._declared.items() if d.hook == who]
            raise StrategyError(f"{label}: sets ctx.hooks.{name}, an output it does not declare (its declared "
                                f"outputs: {', '.join(own) or 'none'}; declare it in the hook's `outputs`)")
        if who != declared.hook:
            raise StrategyError(f"{label}: sets ctx.hooks.{name}, an output of {declared.hook}")
        out = declared.output
        if not self._fits(out, value):
            raise StrategyError(f"{label}: output '{name}' must be "
                                f"{out.describe(self._window, self._vocab, self._logits_dtype)}, got {_describe(value)}")
        self._values[name] = value

    def _fits(self, out: Output, value: Any) -> bool:
        if out.shape == ():
            # bool is an int in Python: a declared int refuses True, a declared float accepts an int
            return type(value) is out.dtype or (out.dtype is float and type(value) is int)
        if not isinstance(value, torch.Tensor):
            return False
        sizes = {"B": self._window[0], "W": self._window[1], "V": self._vocab}
        dtype = self._logits_dtype if out.dtype == "logits" else out.dtype
        return value.dtype == dtype and tuple(value.shape) == tuple(sizes[d] for d in out.shape)

    def _load(self, values: Mapping[str, Any]) -> None:
        """Set outputs already checked (a captured rule's context is rebuilt from them)."""
        self._values.update(values)


def hook_label(hook: Any) -> str:
    """How messages name a step hook: its ``name``, else (the default ``"hook"``) its class."""
    name = getattr(hook, "name", "hook")
    return name if name != "hook" else f"step hook '{type(hook).__qualname__}'"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor"
    return f"{type(value).__name__} {value!r}"[:120]
