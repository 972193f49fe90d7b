"""What the host knows about one step: a value returned by the engine's one host read
(:meth:`~dlm_toolkit.decoding.engine.StepEngine.read`) and passed to every stage that uses it (the block
schedule's ``prepare`` and ``finish_step``, the forward, :func:`~dlm_toolkit.step.canvas.write_step`).

Nothing here is ever written into the :class:`~dlm_toolkit.step.state.DecodeState`: a step that did not
read the host gets :meth:`StepFacts.later` of the last read's value, which keeps only what still holds
(a bound that grows by one per step, the forward width the read chose) and forgets the rest, so a fast
path can only be taken on facts of its own step. Each fact's user states the precondition it proves
next to the fast path. :class:`SavedLayout` is the engine's one cache of a layout those facts key.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StepFacts:
    """Host facts of one step (module docstring). The defaults are what holds before the first read."""

    # this step's forward follows a read (False: a step between reads, or before the first one)
    read: bool = False
    # the largest ``post`` counter of a live row at the last read (0 before it: every row starts at 0);
    # ``None``: unknown. ``since``: steps since that read. A schedule whose ``prepare`` adds at most one
    # to a row's ``post`` knows ``post <= post_max + since + 1`` after its next ``prepare``.
    post_max: int | None = 0
    since: int = 0
    # (this step's read) some live row began this step with no mask in its active block (a post step)
    post_any: bool | None = None
    # (this step's read, where it reads every row's window end) the least and the largest ``hi``
    window_ends: tuple[int, int] | None = None
    # the forward width the last read chose (cache on: W, W + block or whole blocks; cache off: the canvas)
    width: int = 0
    # (trim) the cache columns (cache on) or canvas positions (cache off) this step's forward needs
    needed: int = 0
    # (trim) the rows live in this step, in order
    live: tuple[int, ...] | None = None
    # (layout reuse) what the step forward's layout depends on: width, needed, live rows and every
    # row's window end, cached length and cache boundary; ``None`` where not read (or right after the prefill)
    layout_key: tuple | None = None
    # (layout reuse) some live row's cache boundary is past its cached length (the forward moves the cache)
    cache_moves: bool = True
    # (layout reuse, fixed block layout) what the step context's positions and masks depend on: the
    # live rows and every row's window end, window start and active block (``None`` where not read)
    context_key: tuple | None = None

    def later(self) -> StepFacts:
        """The facts of the next step when it does not read the host: the bound on ``post`` and the
        width carry over; everything of this step alone is forgotten."""
        return replace(self, read=False, since=self.since + 1, post_any=None, window_ends=None, needed=0, live=None,
                       layout_key=None, cache_moves=True, context_key=None)


UNKNOWN = StepFacts(post_max=None)  # nothing known: every stage takes its general path


@dataclass
class SavedLayout:
    """(layout reuse) A layout of the last step that built one, and its key: the step forward's
    (:attr:`StepFacts.layout_key`: the window's positions, real slots, groups, cache writes and start;
    the forward's mask with the cache columns, writes and tokens per row, set by its run) or the step
    context's (:attr:`StepFacts.context_key`: positions, canvas index and masks, ``window`` only)."""

    key: tuple | None = None
    window: tuple[torch.Tensor, ...] = ()
    run: tuple[torch.Tensor, ...] | None = None
