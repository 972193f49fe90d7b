"""The strategy authoring API: the four role base classes and the :class:`StepContext`.

A strategy is a small class with a nested pydantic ``Config`` and a ``__call__(ctx)`` that
returns a boolean ``(B, W)`` selection over the window (or a :class:`Selection` carrying
memory to the next step). Strategy objects hold only their config: everything that changes
during a decode lives in :class:`~dlm_toolkit.step.state.DecodeState` / :class:`StepContext`, so one
policy object can serve many concurrent decodes.

Per forward, the :class:`~dlm_toolkit.decoding.policy.DecodingPolicy` calls, in order:
``m2t(ctx)`` → ``ctx.commit``; ``t2t(ctx)`` → ``ctx.edit``; ``remask(ctx)`` → ``ctx.remask``;
then writes all three at once and lets the block schedule react. An M2T rule that also subclasses
:class:`~dlm_toolkit.hooks.verify.Verifier` gets one more forward over its draft before the write
(a verification forward) and decides from it which drafted writes to keep. A T2T rule that also
subclasses :class:`~dlm_toolkit.hooks.indel.Indel` may insert masks into, and delete tokens from, the
active block after the write (the block's content shifts). A rule that subclasses
:class:`~dlm_toolkit.hooks.shadow.Shadow` gets ``ctx.shadow_confidence`` (WINO's shadow block).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dlm_toolkit.config import RoleSpec, StrategyConfig, validate_model
from dlm_toolkit.step.facts import UNKNOWN, StepFacts
from dlm_toolkit.step.flags import StrategyError  # noqa: F401  (re-exported: old imports)
from dlm_toolkit.step.state import DecodeState
# what a rule sees and returns, and the hook outputs' types, live in the step's leaf package (hooks and
# the loop use them without importing the rules API); re-exported here, where authors import them
from dlm_toolkit.step.context import Selection, StepContext, cached_property  # noqa: F401
from dlm_toolkit.step.outputs import DIMS, SCALARS, Declared, HookOutputs, Output, hook_label  # noqa: F401


class Strategy:
    """Base of all strategies: holds a validated ``Config`` and nothing else."""

    role: ClassVar[str]
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig
    registered_name: ClassVar[str]

    def __init__(self, config: StrategyConfig | Mapping[str, Any] | None = None, **params: Any):
        if isinstance(config, StrategyConfig):
            if params:
                config = config.model_copy(update=params)
            self.config = validate_model(self.Config, config.model_dump())
        else:
            merged = {**(config or {}), **params}
            self.config = validate_model(self.Config, merged, f"{self.role}.params")

    @property
    def name(self) -> str:
        # only the class's own registration counts: a subclass is not its registered parent
        own = type(self).__dict__.get("registered_name")
        return own or f"{type(self).__module__}:{type(self).__qualname__}"

    def spec(self) -> RoleSpec:
        return RoleSpec(name=self.name, params=self.config.model_dump(mode="json"))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.model_dump().items())
        return f"{type(self).__name__}({args})"


class UnmaskRule(Strategy):
    """M2T: which masked positions of the active block to commit this step.

    Contract: the selection lies inside ``ctx.fillable`` and holds at least one position in
    every row whose active block still has a masked position (so every step makes progress).
    """

    role = "m2t"

    def __call__(self, ctx: StepContext) -> torch.Tensor | Selection:
        raise NotImplementedError


class EditRule(Strategy):
    """T2T: which written positions to overwrite with ``ctx.sampled`` this step.

    Contract: the selection lies inside ``ctx.editable``. Positions committed by M2T in this
    same step are not editable (they become so from the next step).
    """

    role = "t2t"

    def __call__(self, ctx: StepContext) -> torch.Tensor | Selection:
        raise NotImplementedError


class RemaskRule(Strategy):
    """Remask: which written positions to turn back into the mask token this step.

    Contract: the selection lies inside ``ctx.editable & ctx.in_block & ~ctx.edit``; it is only applied while
    the active block still had masks at the start of the step, and must leave net progress:
    per row, ``commit.sum() - remask.sum() >= 1``. This keeps NFE bounded.
    """

    role = "remask"

    def __call__(self, ctx: StepContext) -> torch.Tensor | Selection:
        raise NotImplementedError


class BlockSchedule(Strategy):
    """Which window each row forwards next, what it attends to, and when a block (or a row) is
    finished.

    Block schedules are the one role that updates :class:`DecodeState` (its ``block``,
    ``post``, ``done`` fields); they keep nothing on ``self``. Lifecycle per decode: ``layout``
    once, then per forward ``prepare`` → ``window`` → ``attention_groups`` / ``cache_boundary``
    → (forward, rules, write) → ``finish_step``. The engine only applies what the schedule says:
    the attention pattern and which positions enter the KV cache are the schedule's to declare.
    A schedule that chooses its block's start and length from what the decode has seen subclasses
    :class:`~dlm_toolkit.hooks.dynamic_blocks.DynamicBlockSchedule` (bounds as per-row data).

    Methods that get ``state`` work on its device tensors and must not read them on the host
    (no ``.item()``, ``.tolist()``, ``if tensor.any()``, boolean indexing): on a GPU each such read
    stalls the decode. Update per-row fields with masked writes (``torch.where``).
    """

    role = "blocks"

    @property
    def block_length(self) -> int:
        return int(self.config.block_length)  # type: ignore[attr-defined]

    def layout(self, prompt_len: torch.Tensor, gen_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row (CPU tensors in, CPU tensors out): block origin (absolute position of block 0),
        first block, number of blocks."""
        raise NotImplementedError

    def prepare(self, state: DecodeState, facts: StepFacts = UNKNOWN) -> torch.Tensor:
        """Finish blocks that need no forward; return ``(N,)`` bool: the rows that forward now.
        ``facts``: what the host knows from the last read (:class:`~dlm_toolkit.step.facts.StepFacts`;
        a schedule may skip work they prove useless; the parameter may be left out)."""
        raise NotImplementedError

    def window(self, state: DecodeState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row in ``rows``: absolute ``[lo, hi)`` of the window whose logits are used.

        Rules see the window; ``hi`` must end the active block.
        """
        raise NotImplementedError

    def attention_groups(self, state: DecodeState, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``(R, T)`` long attention group of each absolute position: a query attends to a key iff
        ``group[key] <= group[query]`` (positions of one group see each other).

        Default: the position's block (``(pos - origin) // block_length``; positions before the
        origin, a prompt laid out with ``align: prompt``, are group -1), which is block-causal
        attention with a bidirectional active block. Full-attention models ignore groups.
        """
        group = torch.div(positions - state.origin[rows, None], state.block_length, rounding_mode="floor")
        return torch.where(positions < state.origin[rows, None], -1, group)

    def cache_boundary(self, state: DecodeState, rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """``(R,)`` absolute position before which everything is final: those positions enter the
        exact KV cache in this forward and are never recomputed. Must lie in ``[cache length, lo]``,
        and a cached position may only attend to positions before the boundary (else its cached keys
        would go stale). Default: the window start ``lo``."""
        return lo

    def window_width(self) -> int:
        """The most positions a window (:meth:`window`) ever spans: the width of every step's
        context, fixed per decode so that every forward has the same shapes (default: a block)."""
        return self.block_length

    def max_forwards_per_block(self) -> int:
        """Forwards one block may take before the engine calls the schedule broken (bounds NFE)."""
        return self.block_length + int(getattr(self.config, "max_post_steps", 0))

    def edit_region(self, state: DecodeState, ctx: StepContext) -> torch.Tensor:
        """(B, W) positions whose written tokens T2T may edit (default: the active block)."""
        return ctx.in_block

    def finish_step(self, state: DecodeState, ctx: StepContext, facts: StepFacts = UNKNOWN) -> None:
        """React to the step just written (e.g. end a converged block); ``facts``: this step's host
        facts (as for :meth:`prepare`; the parameter may be left out)."""
        raise NotImplementedError


ROLE_BASES: dict[str, type[Strategy]] = {
    "m2t": UnmaskRule,
    "t2t": EditRule,
    "blocks": BlockSchedule,
    "remask": RemaskRule,
}

# the step selection each selecting role fills (ctx.commit / ctx.edit / ctx.remask)
ROLE_SELECTION: dict[str, str] = {"m2t": "commit", "t2t": "edit", "remask": "remask"}
