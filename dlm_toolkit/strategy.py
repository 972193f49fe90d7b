"""The strategy authoring API: the four role base classes and the :class:`StepContext`.

A strategy is a small class with a nested pydantic ``Config`` and a ``__call__(ctx)`` that
returns a boolean ``(B, W)`` selection over the window (or a :class:`Selection` carrying
memory to the next step). Strategy objects hold only their config: everything that changes
during a decode lives in :class:`~dlm_toolkit.state.DecodeState` / :class:`StepContext`, so one
policy object can serve many concurrent decodes.

Per forward, the :class:`~dlm_toolkit.policy.DecodingPolicy` calls, in order:
``m2t(ctx)`` → ``ctx.commit``; ``t2t(ctx)`` → ``ctx.edit``; ``remask(ctx)`` → ``ctx.remask``;
then writes all three at once and lets the block schedule react.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch

from dlm_toolkit.config import RoleSpec, StrategyConfig, validate_model

if TYPE_CHECKING:
    from dlm_toolkit.state import DecodeState


@dataclass(frozen=True)
class Selection:
    """A rule's output when it wants memory: ``select`` ``(B, W)`` bool, ``memory`` anything.

    ``memory`` is stored in the decode state and handed back as ``ctx.memory[role]`` on the
    next forward (of the same decode).
    """

    select: torch.Tensor
    memory: Any = None


@dataclass
class StepContext:
    """Everything a rule may look at for one forward. All tensors cover the rows forwarded
    now (``B`` of them) and the window (``W`` positions); ``rows`` maps them to batch rows.

    Selections decided earlier in the same step are filled in as the policy goes:
    ``commit`` before ``t2t`` runs, ``edit`` before ``remask`` runs.
    """

    rows: torch.Tensor  # (B,) batch row of each context row
    positions: torch.Tensor  # (B, W) absolute canvas positions
    tokens: torch.Tensor  # (B, W) tokens before this step
    valid: torch.Tensor  # (B, W) a real canvas position (False for padding)
    masked: torch.Tensor  # (B, W) holds the mask token
    is_prompt: torch.Tensor  # (B, W)
    in_block: torch.Tensor  # (B, W) inside the active block (where M2T may commit)
    editable: torch.Tensor  # (B, W) written, non-prompt, inside the schedule's edit window
    sampled: torch.Tensor  # (B, W) token drawn from this forward
    confidence: torch.Tensor  # (B, W) float32 probability of `sampled`
    logits: torch.Tensor  # (B, W, V) float32 logits (mask token at -inf if sampling.suppress_mask)
    written_step: torch.Tensor  # (B, W) row step at which the token was written (-1: never)
    written_conf: torch.Tensor  # (B, W) confidence when it was written
    step: torch.Tensor  # (B,) forwards this row has had before this one
    block: torch.Tensor  # (B,) active block index
    block_step: torch.Tensor  # (B,) forwards of this row in its active block before this one
    block_masked_start: torch.Tensor  # (B,) masked positions of the active block when it began
    post: torch.Tensor  # (B,) the active block had no mask when this step began
    generator: torch.Generator
    memory: Mapping[str, Any]
    mask_token_id: int
    eos_token_id: int
    commit: torch.Tensor | None = None
    edit: torch.Tensor | None = None
    remask: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @cached_property
    def probs(self) -> torch.Tensor:
        """(B, W, V) softmax of the raw logits."""
        return torch.softmax(self.logits, dim=-1)

    @cached_property
    def token_confidence(self) -> torch.Tensor:
        """(B, W) probability the model now gives the token already in each position."""
        return self.probs.gather(-1, self.tokens.unsqueeze(-1)).squeeze(-1)

    @cached_property
    def fillable(self) -> torch.Tensor:
        """(B, W) positions M2T may commit: masked and inside the active block."""
        return self.masked & self.in_block

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        return self.tokens.shape[1]


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
    """Which window each row forwards next, and when a block (or a row) is finished.

    Block schedules are the one role that updates :class:`DecodeState` (its ``block``,
    ``post``, ``done`` fields); they keep nothing on ``self``. Lifecycle per decode:
    ``layout`` once, then per forward ``prepare`` → ``window`` → (forward, rules) →
    ``finish_step``.
    """

    role = "blocks"

    @property
    def block_length(self) -> int:
        return int(self.config.block_length)  # type: ignore[attr-defined]

    def layout(self, prompt_len: torch.Tensor, gen_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per row: block origin (absolute position of block 0), first block, number of blocks."""
        raise NotImplementedError

    def prepare(self, state: DecodeState) -> torch.Tensor:
        """Finish blocks that need no forward; return the rows that forward now (long, sorted)."""
        raise NotImplementedError

    def window(self, state: DecodeState, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row in ``rows``: absolute ``[lo, hi)`` of the window whose logits are used.

        All windows of one step have the same width. Positions in ``[lo, hi)`` attend to each
        other bidirectionally; ``hi`` must end the active block.
        """
        raise NotImplementedError

    def max_forwards_per_block(self) -> int:
        """Forwards one block may take before the engine calls the schedule broken (bounds NFE)."""
        return self.block_length + int(getattr(self.config, "max_post_steps", 0))

    def edit_region(self, state: DecodeState, ctx: StepContext) -> torch.Tensor:
        """(B, W) positions whose written tokens T2T may edit (default: the active block)."""
        return ctx.in_block

    def finish_step(self, state: DecodeState, ctx: StepContext) -> None:
        """React to the step just written (e.g. end a converged block)."""
        raise NotImplementedError


ROLE_BASES: dict[str, type[Strategy]] = {
    "m2t": UnmaskRule,
    "t2t": EditRule,
    "blocks": BlockSchedule,
    "remask": RemaskRule,
}
