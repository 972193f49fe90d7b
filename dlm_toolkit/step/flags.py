"""Device flags: errors found on the device, raised at the engine's one host read.

A step never reads the device on the host to find out that something went wrong (a rule selected a
forbidden position, a dynamic block left the canvas, an insert pushed a token out of its block).
Instead whoever finds it *sets a flag*: a per-row bool on the device, with an optional per-row
payload of longs (e.g. ``(kind, lo, hi, position)``) kept from the row's first hit. The engine's
one host read (:meth:`~dlm_toolkit.decoding.engine.StepEngine.read`) carries every flag's pending values
along with the rest of what it reads; on a hit, the flag's message factory builds one error (host
reads are allowed there: the decode is failing) and the decode raises it.

A flag is declared once, as a :class:`DeviceFlag` (name, message factory, error class, payload
width). Who may declare one:

- the core: the step checks (:class:`~dlm_toolkit.decoding.policy.StepChecks`) and the engine's own
  schedule errors, with :func:`declare` when their module is imported;
- any step hook, through the ``flags`` of its declaration (:class:`dlm_toolkit.hooks.Declaration`).

:class:`FlagTable` is the registered table of a policy (``policy.flags``): its names are unique
(a collision is a :class:`~dlm_toolkit.config.ConfigError` naming both declarers, when the policy
is built). :class:`FlagBoard` holds one decode's pending values (``DecodeState.flags``); a hook sets
a flag with :func:`set_flag`. Errors are raised earliest first: the step a flag was set in, then
the table's order (the step checks, the hooks' flags, the engine's), then the batch row.

This module is a leaf (it imports nothing of the toolkit but the config errors), so every module
that raises :class:`StrategyError` imports it from here without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from dlm_toolkit.config import ConfigError

MAX_PAYLOAD = 16  # longs per row a flag may carry


class StrategyError(RuntimeError):
    """A rule broke its role's contract (wrong shape, forbidden positions, no progress)."""


class NonFiniteLogitsError(StrategyError):
    """The model produced NaN or infinite logits where the rules read them."""


@dataclass(frozen=True)
class FlagHit:
    """What a message factory gets: the flag's first hit to raise (host values) and where to look
    for more (``state``, ``source``: host reads allowed, the decode is failing)."""

    flag: DeviceFlag
    owner: str  # who declared the flag (a hook's name, "the step engine", ...)
    row: int  # the batch row
    step: int  # steps the decode had finished when the flag was set in this row
    payload: tuple[int, ...]  # the row's payload at its first hit (``flag.payload`` longs)
    state: Any  # the DecodeState
    source: Any  # the object that last set the flag (``set_flag(..., source=)``), or None


@dataclass(frozen=True)
class DeviceFlag:
    """One kind of error a decode may find on the device (module docstring).

    ``message(hit)`` returns the error's text; the decode raises ``error(text)``. ``payload``: longs
    kept per row from its first hit (0: just the bool)."""

    name: str
    message: Callable[[FlagHit], str] = field(compare=False)
    error: type[Exception] = StrategyError
    payload: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"device flag name: must be a non-empty string, got {self.name!r}")
        if not callable(self.message):
            raise ConfigError(f"device flag '{self.name}': message must be callable (hit -> str), "
                              f"got {type(self.message).__name__}")
        if not (isinstance(self.error, type) and issubclass(self.error, Exception)):
            raise ConfigError(f"device flag '{self.name}': error must be an exception class, got {self.error!r}")
        if isinstance(self.payload, bool) or not isinstance(self.payload, int) or not 0 <= self.payload <= MAX_PAYLOAD:
            raise ConfigError(f"device flag '{self.name}': payload must be an integer in [0, {MAX_PAYLOAD}], "
                              f"got {self.payload!r}")


_CORE_FIRST: list[tuple[str, DeviceFlag]] = []  # raised before the hooks' flags (the step checks)
_CORE_LAST: list[tuple[str, DeviceFlag]] = []  # raised after them (the engine's schedule errors)


def declare(owner: str, flags: Iterable[DeviceFlag], *, after_hooks: bool = False) -> None:
    """Register core flags (every policy's table holds them), once, when their module is imported."""
    target = _CORE_LAST if after_hooks else _CORE_FIRST
    for flag in flags:
        if all(f.name != flag.name for _, f in _CORE_FIRST + _CORE_LAST):
            target.append((owner, flag))


class FlagTable:
    """The registered flags of a policy: the core's and its hooks', each name once.

    Raises:
        ConfigError: a name declared twice, naming both declarers.
    """

    def __init__(self, declared: Iterable[tuple[str, DeviceFlag]] = ()):
        self.entries: list[tuple[str, DeviceFlag]] = []
        self.owners: dict[str, str] = {}
        self.order: dict[str, int] = {}
        for owner, flag in (*_CORE_FIRST, *declared, *_CORE_LAST):
            if flag.name in self.owners:
                raise ConfigError(f"device flag '{flag.name}' is declared by {self.owners[flag.name]} and by {owner}: "
                                  "flag names must be unique in a policy (rename one)")
            self.owners[flag.name] = owner
            self.order[flag.name] = len(self.entries)
            self.entries.append((owner, flag))


class FlagBoard:
    """One decode's pending flag values on the device (``DecodeState.flags``).

    Each flag set so far has a slab of longs: ``(N, 1 + payload)`` (column 0: 0 while the row has no
    hit, else 1 + the step it was first hit in), or, for payload-free flags set together with
    :meth:`set_many`, ``(N, K)`` with one such column per flag (set once since the last read: the
    bool hits themselves, their step in :attr:`fresh`)."""

    def __init__(self, table: FlagTable | None, rows: int, device: torch.device):
        self.table: FlagTable | None = None
        self.rows, self.device = rows, device
        self.step = 0  # steps finished (StepChecks.add counts them): a hit's "when"
        self.slabs: dict[str, torch.Tensor] = {}
        self.fresh: dict[str, int] = {}  # slab -> 1 + its step, for a set_many slab that holds bool hits as set
        self.columns: dict[str, tuple[str, int]] = {}  # flag name -> (slab, column)
        self.flags: dict[str, DeviceFlag] = {}
        self.sources: dict[str, Any] = {}
        if table is not None:
            self.adopt(table)

    def adopt(self, table: FlagTable) -> None:
        """Take the policy's table (the engine's first read; a block schedule may set flags in its
        first ``prepare``, before it): every flag set so far must be in it."""
        self.table = table
        for flag in self.flags.values():
            self._registered(flag)

    def owner(self, flag: DeviceFlag) -> str:
        owners = self.table.owners if self.table is not None else {}
        return owners.get(flag.name, f"device flag '{flag.name}'")

    def _registered(self, flag: DeviceFlag) -> None:
        if self.table is not None and self.table.owners.get(flag.name) is None:
            raise StrategyError(f"device flag '{flag.name}' was set but no hook of the policy declares it "
                                "(list it in the flags of the hook's declaration: Declaration(flags=[...]))")

    def _claim(self, flag: DeviceFlag, slab: str, column: int) -> None:
        self._registered(flag)
        self.flags[flag.name] = flag
        self.columns[flag.name] = (slab, column)

    def _check(self, flag: DeviceFlag, hit: Any, payload: Any, k: int = 1) -> None:
        """Metadata only (no host read): a bool ``(N,)`` hit, a long ``(N, payload)`` payload."""
        n = self.rows
        shape = (n,) if k == 1 else (n, k)

        def bad(t: Any) -> str:
            return f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__

        if not (isinstance(hit, torch.Tensor) and hit.dtype == torch.bool and tuple(hit.shape) == shape):
            raise StrategyError(f"{self.owner(flag)}: device flag '{flag.name}' must be set with a bool tensor of "
                                f"shape {shape} (one per batch row), got {bad(hit)}")
        if flag.payload:
            if not (isinstance(payload, torch.Tensor) and payload.dtype == torch.long
                    and tuple(payload.shape) == (n, flag.payload)):
                raise StrategyError(f"{self.owner(flag)}: device flag '{flag.name}' must be set with a long payload "
                                    f"of shape {(n, flag.payload)}, got {bad(payload)}")
        elif payload is not None:
            raise StrategyError(f"{self.owner(flag)}: device flag '{flag.name}' declares no payload, got one")

    def set(self, flag: DeviceFlag, hit: torch.Tensor, payload: torch.Tensor | None = None,
            source: Any = None) -> None:
        """Flag the rows where ``hit`` ((N,) bool) holds; a row keeps its first hit (and payload)."""
        self._check(flag, hit, payload)
        old = self.slabs.get(flag.name)
        if old is None:
            self._claim(flag, flag.name, 0)
            old = torch.zeros(self.rows, 1 + flag.payload, dtype=torch.long, device=self.device)
        first = hit & (old[:, 0] == 0)
        if flag.payload:
            assert payload is not None
            new = torch.cat([torch.full_like(payload[:, :1], self.step + 1), payload], 1)
            self.slabs[flag.name] = torch.where(first[:, None], new, old)
        else:
            self.slabs[flag.name] = old.masked_fill(first[:, None], self.step + 1)
        if source is not None:
            self.sources[flag.name] = source

    def set_many(self, flags: Sequence[DeviceFlag], hits: torch.Tensor, source: Any = None) -> None:
        """Set payload-free ``flags`` at once from ``hits`` ((N, K) bool, column k for ``flags[k]``): one
        slab, one update (the step checks set their flags this way every step).

        The first set since the last read keeps ``hits`` itself as the slab (no op on the device;
        the step is kept on the host, :attr:`fresh`), so do not write into ``hits`` afterwards; a
        second set before the read turns it into the usual long slab."""
        key = "+".join(f.name for f in flags)
        self._check(flags[0], hits, None, len(flags))
        old = self.slabs.get(key)
        if old is None:
            if self.columns.get(flags[0].name, ("",))[0] != key:  # the first set in this decode
                for k, flag in enumerate(flags):
                    if flag.payload:
                        raise StrategyError(f"{self.owner(flag)}: device flag '{flag.name}' has a payload; "
                                            "set it with set()")
                    self._claim(flag, key, k)
            self.slabs[key] = hits
            self.fresh[key] = self.step + 1
        else:
            if key in self.fresh:  # set twice between reads: 0 / 1 + the step of the first set
                old = old.long() * self.fresh.pop(key)
            self.slabs[key] = old.masked_fill(hits & (old == 0), self.step + 1)
        if source is not None:
            for flag in flags:
                self.sources[flag.name] = source

    def consumed(self) -> None:
        """A read found no flag set (:meth:`raise_first` returned): drop the slabs that still hold a
        step's hits as they were set (every value in them is 0), so the next :meth:`set_many` of
        each starts afresh without touching the device."""
        for key in self.fresh:
            del self.slabs[key]
        self.fresh.clear()

    def raise_host(self, flag: DeviceFlag, row: int, state: Any, source: Any = None) -> None:
        """Raise ``flag`` as hit now in batch row ``row``, found on the host from values a read brought
        there (the engine's own checks, when it reads every row): the error :meth:`raise_first` would
        raise for the flag set at this step, after everything pending was raised."""
        self._registered(flag)
        hit = FlagHit(flag=flag, owner=self.owner(flag), row=row, step=self.step, payload=(), state=state,
                      source=source)
        raise flag.error(flag.message(hit))

    def pending(self) -> list[torch.Tensor]:
        """Every slab, flattened (the engine concatenates them into its one read; :meth:`raise_first`
        decodes them in this order)."""
        return [s.flatten() for s in self.slabs.values()]

    def raise_first(self, host: Sequence[int], state: Any) -> None:
        """Given the host values of :meth:`pending`, raise the earliest hit's error (module docstring);
        nothing when no flag is set."""
        if not any(host):
            return
        offsets: dict[str, int] = {}
        at = 0
        for key, slab in self.slabs.items():
            offsets[key] = at
            at += slab.numel()
        best: tuple[int, int, int, DeviceFlag, tuple[int, ...]] | None = None
        for name, (key, col) in self.columns.items():
            flag, width = self.flags[name], self.slabs[key].shape[1]
            order = self.table.order.get(name, len(self.table.order)) if self.table is not None else 0
            for r in range(self.rows):
                base = offsets[key] + r * width
                when = host[base + col]
                if when and key in self.fresh:  # a slab of the hits themselves (set_many): its step is kept here
                    when = self.fresh[key]
                if when and (best is None or (when, order, r) < best[:3]):
                    best = (when, order, r, flag, tuple(host[base + 1:base + 1 + flag.payload]))
        if best is None:
            return
        when, _, r, flag, payload = best
        hit = FlagHit(flag=flag, owner=self.owner(flag), row=r, step=when - 1, payload=payload, state=state,
                      source=self.sources.get(flag.name))
        raise flag.error(flag.message(hit))


def board(state: Any) -> FlagBoard:
    """The decode's :class:`FlagBoard` (made on first use; the engine's first read makes it with the
    policy's table, before any step runs)."""
    if state.flags is None:
        state.flags = FlagBoard(None, state.batch_size, state.device)
    return state.flags


def set_flag(state: Any, flag: DeviceFlag, hit: torch.Tensor, payload: torch.Tensor | None = None,
             source: Any = None) -> None:
    """Set ``flag`` in the rows of ``state`` where ``hit`` ((N,) bool) holds, with ``payload``
    ((N, flag.payload) long) kept from each row's first hit. Device only; wrong dtype or shape:
    :class:`StrategyError` naming the declaring hook (metadata, no host read)."""
    board(state).set(flag, hit, payload, source)


def pending_payload(state: Any, flag: DeviceFlag) -> torch.Tensor | None:
    """``(N, flag.payload)``: each row's payload at its first hit (zeros where none), or None when
    the flag was never set in this decode (for tests and tools; reading it syncs the host)."""
    b = state.flags
    if b is None or flag.name not in b.columns:
        return None
    key, _ = b.columns[flag.name]
    if key != flag.name or key not in b.slabs:  # set_many's slabs carry no payload; a read dropped them
        return torch.zeros(b.rows, flag.payload, dtype=torch.long, device=b.device)
    return b.slabs[key][:, 1:]
