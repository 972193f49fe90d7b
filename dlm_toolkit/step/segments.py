"""Segments: the pieces one model forward is laid out from, each with its own attention rule.

A forward of the decode engine is a list of :class:`Segment` objects laid side by side along the
forward's width: the first is the *primary* segment (a step's window span, or a verification's
drafted span), the others are extra copies a hook appends (the shadow block, the verification's
masked copy of the active block). Each segment says, per row, its token ids, absolute positions,
which slots are real, its attention groups, and how its queries see

- the cached prefix (``see_cache``): cached keys whose group is at most the query's group;
- the primary segment (``see_primary``), itself (``see_self``) and every other appended segment
  (``see_others``): one :class:`Keys` rule each, comparing the keys' ``order`` with the query's;

and which of its slots it writes into the KV cache (``write``; ``None``: none). Every slot sees
itself (a padding query sees only itself, so no attention row is empty), and only real slots are
ever seen. :func:`layout` turns a list of segments into the forward's ``(ids, pos, allowed)``;
the engine (:meth:`~dlm_toolkit.decoding.engine.StepEngine.run`) adds the cache columns and runs it.

Examples (block-causal models):

- the step's window: ``see_self=Keys.UP_TO`` (keys of its group or earlier), ``see_cache=True``;
- the shadow block (:mod:`dlm_toolkit.hooks.shadow`): the window's keys of its group or earlier except
  the key at its own position (``Keys.UP_TO`` with ``hide_own_position``), every shadow key
  (``Keys.ALL``); the window does not see it (``see_others=Keys.NONE`` on the window);
- a verification's copy (:mod:`dlm_toolkit.hooks.verify`): token-causal ``order`` keys, primary keys
  strictly before it (``Keys.BEFORE``), nothing else of its own segment.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from dlm_toolkit.step.flags import StrategyError


class Keys(enum.Enum):
    """Which real keys of a segment a query sees, by ``order`` (key's vs. the query's)."""

    NONE = "none"  # no key
    ALL = "all"  # every real key
    UP_TO = "up_to"  # keys whose order is at most the query's
    BEFORE = "before"  # keys whose order is strictly less than the query's


@dataclass
class Segment:
    """One piece of a forward (module docstring). Tensors are per batch row of the decode (N rows).

    Attributes:
        ids: (N, T) long token ids.
        pos: (N, T) long absolute positions, inside the canvas (``[0, canvas length)``).
        real: (N, T) bool slots that take part; the rest is padding (sees only itself, never seen).
        group: (N, T) long attention groups (the block schedule's ``attention_groups`` of ``pos``);
            the cached prefix is seen by group. ``None`` only for full-attention models.
        order: (N, T) long keys the :class:`Keys` rules compare between segments of one forward;
            ``None``: ``group``.
        see_cache: the queries see cached keys of their group or earlier.
        see_primary / see_self / see_others: the rule against the primary segment, against this
            segment and against the other appended segments (for the primary segment itself,
            ``see_self`` applies and ``see_primary`` is ignored).
        hide_own_position: a query never sees a primary-segment key at its own absolute position.
        write: (N, T) bool slots whose keys and values this forward writes into the KV cache;
            ``None``: nothing.
        own: (N, T, T) bool attention among the segment's own slots, when its builder has it more
            cheaply than ``see_self`` would build it (it must be exactly that rule's result; the
            engine's window does, without the cache); ``None``: built from ``see_self``.
    """

    ids: torch.Tensor
    pos: torch.Tensor
    real: torch.Tensor
    group: torch.Tensor | None
    order: torch.Tensor | None = None
    see_cache: bool = True
    see_primary: Keys = Keys.NONE
    see_self: Keys = Keys.UP_TO
    see_others: Keys = Keys.NONE
    hide_own_position: bool = False
    write: torch.Tensor | None = None
    own: torch.Tensor | None = None

    @property
    def width(self) -> int:
        """Slots of the segment (T)."""
        return self.ids.shape[1]

    def keys(self) -> torch.Tensor | None:
        """The ``order`` keys the rules compare (``group`` when no ``order`` is given)."""
        return self.group if self.order is None else self.order


def check(segment: object, rows: int, who: str) -> Segment:
    """``segment`` if it is a :class:`Segment` whose tensors are shaped ``(rows, T)`` with the
    dtypes of its fields, else a :class:`~dlm_toolkit.decoding.policy.StrategyError` naming ``who`` and the
    field (metadata only: no host read)."""
    if not isinstance(segment, Segment):
        raise StrategyError(f"{who}: a forward segment must be a dlm_toolkit.step.segments.Segment, got "
                            f"{type(segment).__name__}")
    ids = segment.ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != rows or ids.shape[1] < 1:
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise StrategyError(f"{who}: segment field 'ids' must be a (batch rows = {rows}, T >= 1) tensor, got {got}")
    shape = tuple(ids.shape)
    kinds = (("ids", torch.long, False), ("pos", torch.long, False), ("real", torch.bool, False),
             ("group", torch.long, True), ("order", torch.long, True), ("write", torch.bool, True))
    for field, dtype, optional in kinds:
        value = getattr(segment, field)
        if value is None and optional:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != shape:
            got = f"{value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) \
                else type(value).__name__
            raise StrategyError(f"{who}: segment field '{field}' must be a {dtype} tensor of shape {shape} "
                                f"(like 'ids'){' or None' if optional else ''}, got {got}")
    own = segment.own
    if own is not None and (not isinstance(own, torch.Tensor) or own.dtype != torch.bool
                            or tuple(own.shape) != (*shape, shape[1])):
        got = f"{own.dtype} tensor of shape {tuple(own.shape)}" if isinstance(own, torch.Tensor) else type(own).__name__
        raise StrategyError(f"{who}: segment field 'own' must be a torch.bool tensor of shape {(*shape, shape[1])} "
                            f"or None, got {got}")
    for field in ("see_primary", "see_self", "see_others"):
        if not isinstance(getattr(segment, field), Keys):
            raise StrategyError(f"{who}: segment field '{field}' must be a dlm_toolkit.step.segments.Keys, got "
                                f"{getattr(segment, field)!r}")
    return segment


def sees(rule: Keys, query: Segment, key: Segment) -> torch.Tensor | None:
    """(N, Tq, Tk) bool: the real keys of ``key`` the real queries of ``query`` see by ``rule``
    (``None``: none)."""
    if rule is Keys.NONE:
        return None
    both = key.real[:, None, :] & query.real[:, :, None]
    if rule is Keys.ALL:
        return both
    qk, kk = query.keys(), key.keys()
    if qk is None or kk is None:  # full attention: no groups to compare, every real key
        return both
    if rule is Keys.UP_TO:
        return both & (kk[:, None, :] <= qk[:, :, None])
    return both & (kk[:, None, :] < qk[:, :, None])


def layout(segments: list[Segment], eye: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, pos, allowed)`` of a forward over ``segments`` side by side: ids and positions
    (N, T) and the attention among the forward's own slots (N, T, T) (module docstring).
    ``eye``: a (T, T) identity to reuse (the engine keeps one per width)."""
    first = segments[0]
    ids = torch.cat([s.ids for s in segments], 1) if len(segments) > 1 else first.ids
    pos = torch.cat([s.pos for s in segments], 1) if len(segments) > 1 else first.pos
    t = pos.shape[1]
    if eye is None:
        eye = torch.eye(t, dtype=torch.bool, device=pos.device)
    if len(segments) == 1:
        own = first.own if first.own is not None else sees(first.see_self, first, first)
        allowed = eye.expand(pos.shape[0], t, t) if own is None else own | eye
        return ids, pos, allowed
    rows = []
    for i, q in enumerate(segments):
        blocks = []
        for j, k in enumerate(segments):
            rule = q.see_self if i == j else q.see_primary if j == 0 else q.see_others
            part = q.own if i == j and q.own is not None else sees(rule, q, k)
            if part is not None and j == 0 and i > 0 and q.hide_own_position:
                part = part & (k.pos[:, None, :] != q.pos[:, :, None])
            blocks.append(part if part is not None else
                          torch.zeros(pos.shape[0], q.width, k.width, dtype=torch.bool, device=pos.device))
        rows.append(torch.cat(blocks, 2))
    return ids, pos, torch.cat(rows, 1) | eye


def cache_seen(segments: list[Segment], in_cache: torch.Tensor, cache_group: torch.Tensor) -> torch.Tensor:
    """(N, T, S) bool: the cached keys each slot of the forward sees: real queries of segments with
    ``see_cache``, keys in the cache (``in_cache`` (N, S)) of the query's group or earlier
    (``cache_group`` (N, S))."""
    parts = []
    for s in segments:
        assert s.group is not None, "a segment that sees the KV cache needs attention groups"
        seen = in_cache[:, None, :] & s.real[:, :, None] & (cache_group[:, None, :] <= s.group[:, :, None])
        parts.append(seen if s.see_cache else torch.zeros_like(seen))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def plain_window(segments: list[Segment]) -> bool:
    """Whether ``segments`` is one window whose attention :func:`window_with_cache` builds: no
    ``own`` pattern, ``see_self=Keys.UP_TO`` by ``group`` (no ``order``), ``see_cache``."""
    if len(segments) != 1:
        return False
    s = segments[0]
    return s.own is None and s.see_self is Keys.UP_TO and s.see_cache and s.order is None and s.group is not None


GROUP_MIN, GROUP_MAX = torch.iinfo(torch.long).min, torch.iinfo(torch.long).max


def window_with_cache(segment: Segment, not_cached: torch.Tensor, cache_group: torch.Tensor,
                      eye: torch.Tensor) -> torch.Tensor:
    """(N, T, S + T) bool: ``cat([cache_seen([segment], ~not_cached, cache_group), layout([segment], eye)[2]], -1)``
    for a segment where :func:`plain_window` holds, in one comparison of groups: a key that is not in
    the cache (``not_cached`` (N, S)) or not real takes the group GROUP_MAX (seen by no query), a
    query that is not real the group GROUP_MIN (sees no key); then every slot sees itself.
    Precondition: every group lies strictly between GROUP_MIN and GROUP_MAX (they are block indices)."""
    group = segment.group
    assert group is not None
    unreal = ~segment.real
    keys = torch.cat([cache_group.masked_fill(not_cached, GROUP_MAX), group.masked_fill(unreal, GROUP_MAX)], 1)
    seen = keys[:, None, :] <= group.masked_fill(unreal, GROUP_MIN)[:, :, None]
    seen.narrow(2, not_cached.shape[1], eye.shape[0]).logical_or_(eye)
    return seen


def cache_writes(segments: list[Segment]) -> torch.Tensor:
    """(N, T) bool: the forward's slots written into the KV cache."""
    parts = [s.write if s.write is not None else torch.zeros_like(s.real) for s in segments]
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]
