"""What a rule sees and returns: :class:`StepContext` (one forward's view of the window) and
:class:`Selection` (a selection carrying memory to the next step).

They live in the step's leaf package because the step's mechanics (the canvas writes), the hooks
and the loop all read them; the rules API (:mod:`dlm_toolkit.strategy.base`) re-exports them, where
strategy authors import them. Nothing here imports the rules, the hooks or the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from dlm_toolkit.config import SamplingConfig
from dlm_toolkit.step.outputs import Declared, HookOutputs

__all__ = ["Selection", "StepContext", "cached_property"]


class cached_property:  # noqa: N801 - functools.cached_property without its lock (Python < 3.12)
    """A value computed on first access and kept in the instance. ``functools.cached_property``
    takes a lock on Python < 3.12, a context manager ``torch.compile`` cannot trace, so rules
    reading ``ctx.fillable`` or ``ctx.probs`` could not be captured."""

    def __init__(self, fn: Any):
        self.fn, self.__doc__ = fn, fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


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
    """Everything a rule may look at for one forward, built by :meth:`build` (the engine and
    :func:`dlm_toolkit.testing.make_context` both go through it).

    Tensors cover every row of the decode batch (``live`` says which forward now) and a window of
    ``W`` positions, ``W`` fixed by the block schedule (:meth:`~dlm_toolkit.strategy.base.BlockSchedule.window_width`), all on
    the model's device. Windows with fewer real positions are left-padded (``valid`` False), so
    every step of a decode has the same shapes. Read-only: the decode loop shares ``positions``,
    ``valid``, ``is_prompt`` and ``in_block`` between the steps of a block, so a rule or hook that
    needs another mask builds a new tensor rather than writing into these.

    ======================  =========  =======  =================================================
    field                   shape      dtype    meaning
    ======================  =========  =======  =================================================
    ``rows``                (B,)       long     batch row of each context row
    ``positions``           (B, W)     long     absolute canvas positions (padding: earlier ones)
    ``tokens``              (B, W)     long     tokens before this step
    ``valid``               (B, W)     bool     a real window position (False for padding)
    ``masked``              (B, W)     bool     valid and holds the mask token
    ``is_prompt``           (B, W)     bool     a prompt position (never written)
    ``in_block``            (B, W)     bool     inside the active block
    ``fillable``            (B, W)     bool     masked & in_block: where M2T may commit
    ``editable``            (B, W)     bool     valid, written, non-prompt, in the schedule's
                                                edit window: where T2T may edit
    ``sampled``             (B, W)     long     token drawn from this forward (never the mask id)
    ``confidence``          (B, W)     float32  probability of ``sampled`` (softmax over the
                                                whole vocabulary, mask token included)
    ``logits``              (B, W, V)  float    raw logits of this forward (model dtype)
    ``probs``               (B, W, V)  float32  their softmax (computed once, shared)
    ``token_confidence``    (B, W)     float32  probability now of the token already there
    ``written_step``        (B, W)     long     row step that wrote the token; -1: never
                                                written (prompt, masked, remasked)
    ``written_conf``        (B, W)     float32  confidence it was written with; 0.0 if never
    ``step``                (B,)       long     forwards this row had before this one
    ``block``               (B,)       long     active block index
    ``block_step``          (B,)       long     forwards in the active block before this one
    ``block_masked_start``  (B,)       long     masked positions of the active block when it
                                                began
    ``post``                (B,)       bool     the active block had no mask at step start
    ``live``                (B,)       bool     the row forwards now (rows that do not, e.g.
                                                finished ones, ride along with every position
                                                invalid; nothing is written for them)
    ``seeds``               (B,)       long     each row's random key: draw with :meth:`rand`,
                                                never from a global generator
    ``memory``              --         --       ``{role: value}`` returned by rules last step
    ``batch_rows``          int        --       rows in the whole decode batch (N >= B)
    ``hooks``               --         --       the step hooks' outputs (:class:`HookOutputs`)
    ======================  =========  =======  =================================================

    Selections decided earlier in the same step are filled in as the policy goes:
    ``commit`` before ``t2t`` runs, ``edit`` before ``remask`` runs.

    What the policy's step hooks (:mod:`dlm_toolkit.hooks`) add lives in one typed namespace,
    ``ctx.hooks``: each hook declares its outputs (``Declaration.outputs``, :mod:`dlm_toolkit.hooks.base`) and
    sets only those, with the declared shape and dtype; a rule reads ``ctx.hooks.<name>`` (None while
    no hook set it this step; a name no hook of the policy declares is an error). The built-in ones:

    =====================  =========  =======  ====================================================
    output                 shape      dtype    set by (stage) / meaning
    =====================  =========  =======  ====================================================
    ``shadow_confidence``  (B, W)     float32  shadow block (after the forward): probability of each
                                               written token of the active block with itself
                                               hidden, 0 elsewhere (:mod:`dlm_toolkit.hooks.shadow`)
    ``verified``           (B,)       bool     verification (after the rules): rows that ran a
                                               verification forward (:mod:`dlm_toolkit.hooks.verify`)
    ``draft``              (B, W)     long     verification: the window as drafted
    ``verify_logits``      (B, W, V)  logits   verification: the verification forward's logits
    ``temperature``        ()         float    verification: the policy's sampling temperature
    ``insert``             (B, W)     bool     insert/delete (after the write): slots a mask was
                                               inserted before (:mod:`dlm_toolkit.hooks.indel`)
    ``delete``             (B, W)     bool     insert/delete: slots whose token was deleted
    =====================  =========  =======  ====================================================

    ``ctx.shadow_confidence``, ``ctx.verified``, ``ctx.insert`` and ``ctx.delete`` read the same
    outputs (read-only; None where the policy has no hook declaring them).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor
    masked: torch.Tensor
    is_prompt: torch.Tensor
    in_block: torch.Tensor
    editable: torch.Tensor
    sampled: torch.Tensor
    confidence: torch.Tensor
    logits: torch.Tensor
    written_step: torch.Tensor
    written_conf: torch.Tensor
    step: torch.Tensor
    block: torch.Tensor
    block_step: torch.Tensor
    block_masked_start: torch.Tensor
    post: torch.Tensor
    live: torch.Tensor
    seeds: torch.Tensor
    memory: Mapping[str, Any]
    mask_token_id: int
    eos_token_id: int
    batch_rows: int
    commit: torch.Tensor | None = None
    edit: torch.Tensor | None = None
    remask: torch.Tensor | None = None
    hooks: HookOutputs = field(default_factory=lambda: HookOutputs())
    draws: int = 0  # rand() calls so far this step: the draw index of the next one
    # (hook, selection name, the selection before): each replacement of commit/edit/remask by a step
    # hook this step, in order (dlm_toolkit.hooks.base.HookStages records them; see selected_by)
    replaced: list[tuple[str, str, torch.Tensor]] = field(default_factory=list)

    def selected_by(self, selection: str, row: int, slot: int) -> str | None:
        """The step hook that put window slot ``slot`` of context row ``row`` into ``selection``
        (``"commit"``, ``"edit"``, ``"remask"``), or None if the rule selected it. A host read: for
        error messages only."""
        after = getattr(self, selection)
        for who, name, before in reversed(self.replaced):
            if name != selection:
                continue
            if bool(after[row, slot]) and not bool(before[row, slot]):
                return who
            after = before
        return None

    @property
    def verified(self) -> torch.Tensor | None:
        """``ctx.hooks.verified`` (None without a verifying rule)."""
        return self.hooks.get("verified")

    @property
    def insert(self) -> torch.Tensor | None:
        """``ctx.hooks.insert`` (None without an insert/delete rule)."""
        return self.hooks.get("insert")

    @property
    def delete(self) -> torch.Tensor | None:
        """``ctx.hooks.delete`` (None without an insert/delete rule)."""
        return self.hooks.get("delete")

    @property
    def shadow_confidence(self) -> torch.Tensor | None:
        """``ctx.hooks.shadow_confidence`` (None without a rule reading the shadow block)."""
        return self.hooks.get("shadow_confidence")

    @classmethod
    def build(
        cls,
        *,
        rows: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        tokens: torch.Tensor,
        prompt_len: torch.Tensor,
        block_lo: torch.Tensor | None,
        block_hi: torch.Tensor | None,
        logits: torch.Tensor,
        sampling: SamplingConfig,
        written_step: torch.Tensor,
        written_conf: torch.Tensor,
        step: torch.Tensor,
        block: torch.Tensor,
        block_step: torch.Tensor,
        block_masked_start: torch.Tensor,
        seeds: torch.Tensor,
        memory: Mapping[str, Any],
        mask_token_id: int,
        eos_token_id: int,
        batch_rows: int,
        live: torch.Tensor | None = None,
        outputs: Mapping[str, Declared] | None = None,
        layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> StepContext:
        """The context of one forward from the canvas window and the logits: derives the masks,
        draws ``sampled``/``confidence`` (:func:`dlm_toolkit.step.sampling.sample`, keyed by each row's
        seed) and leaves ``editable`` at "written, non-prompt" (with ``layout``: its ``writable``
        slots not masked); the caller narrows it to the schedule's edit window. ``prompt_len``, ``block_lo``, ``block_hi``, ``seeds``, ``live``:
        (B,) per row (``live`` defaults to every row; ``valid`` must already exclude the rest).
        ``outputs``: the hook outputs the policy declares (:func:`dlm_toolkit.hooks.base.declared_outputs`; none
        by default). ``layout``: :meth:`window_masks` of these positions when the caller has them
        (``block_lo``/``block_hi`` are then unused). Reads nothing back to the host."""
        from dlm_toolkit.step.sampling import sample

        live = torch.ones_like(rows, dtype=torch.bool) if live is None else live
        masked = (tokens == mask_token_id) & valid
        if layout is None:
            assert block_lo is not None and block_hi is not None
            layout = cls.window_masks(positions, valid, prompt_len, block_lo, block_hi)
        is_prompt, in_block, writable = layout
        fillable = masked & in_block
        ctx = cls(
            rows=rows, positions=positions, tokens=tokens, valid=valid, masked=masked, is_prompt=is_prompt,
            # writable & ~masked, as a > b on bools: one op fewer
            in_block=in_block, editable=writable > masked, sampled=tokens, confidence=written_conf,
            logits=logits, written_step=written_step, written_conf=written_conf, step=step, block=block,
            block_step=block_step, block_masked_start=block_masked_start,
            post=live > fillable.any(1), live=live, seeds=seeds,
            memory=memory, mask_token_id=mask_token_id, eos_token_id=eos_token_id, batch_rows=batch_rows,
            hooks=HookOutputs(outputs or {}, tokens.shape, logits.shape[-1], logits.dtype),
        )
        sampled, confidence, probs = sample(logits, sampling, mask_token_id, ctx.rand)
        ctx.sampled, ctx.confidence = sampled, confidence
        # cached properties computed here already: the sampler's softmax, and the fillable mask
        ctx.__dict__["probs"] = probs
        ctx.__dict__["fillable"] = fillable
        return ctx

    @staticmethod
    def window_masks(positions: torch.Tensor, valid: torch.Tensor, prompt_len: torch.Tensor, block_lo: torch.Tensor,
                     block_hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(is_prompt, in_block, writable)``, each (B, W) bool, of a window: prompt positions, positions
        in ``[block_lo, block_hi)`` and the valid non-prompt ones (``editable`` before the mask test).
        They depend on the positions and the window's bounds only, so the decode loop keeps them
        while those stay the same; it may narrow ``writable`` to an edit region that is one of them."""
        is_prompt = positions < prompt_len[:, None]
        in_block = (positions >= block_lo[:, None]) & (positions < block_hi[:, None])
        return is_prompt, in_block, valid > is_prompt  # a > b: a & ~b on bools

    def rand(self, *trailing: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(B, W, *trailing)`` uniform numbers in [0, 1) (padding and rows not forwarded get 1.0).

        Counter-based (:mod:`dlm_toolkit.step.rng`): the number at a position is a hash of the row's
        seed, its step, the absolute position, this call's index within the step and the trailing
        index. A row therefore draws the same numbers whatever batch it is in and however wide the
        window is (a batch decodes row for row as each prompt alone, at any temperature and with
        random rules), with no loop over rows and nothing read back to the host.
        """
        from dlm_toolkit.step import rng

        base = rng.key(self.seeds, self.step, self.positions, self.draws)
        self.draws += 1
        u = rng.uniform(base, trailing, dtype)
        return u.masked_fill(~self.valid.view(*self.valid.shape, *[1] * len(trailing)), 1.0)

    @property
    def n_valid(self) -> list[int]:
        """Real window positions per row, as host ints (a host sync: not for the per-step path)."""
        return self.valid.sum(1).tolist()

    @cached_property
    def probs(self) -> torch.Tensor:
        """(B, W, V) float32 softmax of the raw logits (mask token included)."""
        return torch.softmax(self.logits.float(), dim=-1)

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

    @property
    def device(self) -> torch.device:
        return self.tokens.device
