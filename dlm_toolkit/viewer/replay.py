"""The canvas of a recorded decode after every forward, replayed from its step records.

A row's canvas starts as its prompt followed by mask tokens. Each :class:`StepRecord` then writes,
in the engine's order: the drawn token at its commits and edits, the mask token at its remasks
(a remask wins over a write of the same step), then the active block as the step left it
(``block_after``: this is where insert/delete shifts show). Besides the token, each position keeps
what last happened to it (:data:`KINDS`) with the confidence of that event and the runner-up token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the viewer reads recorded trajectories; the step names the viewer for Jupyter's display
    from dlm_toolkit.step.trajectory import StepRecord, Trajectory

# What last happened to a position; the index is what the page's JSON carries.
KINDS = ("prompt", "masked", "commit", "edit", "remask", "insert", "delete")
PROMPT, MASKED, COMMIT, EDIT, REMASK, INSERT, DELETE = range(len(KINDS))


@dataclass
class Cell:
    """One canvas position: its token, what last happened to it, at which confidence (-1: none),
    and the runner-up token of that event (-1: none) with its probability."""

    token: int
    kind: int
    confidence: float = -1.0
    runner_up: int = -1
    runner_up_confidence: float = -1.0

    def key(self) -> tuple[int, int, float, int, float]:
        return (self.token, self.kind, self.confidence, self.runner_up, self.runner_up_confidence)


@dataclass
class Frame:
    """The canvas after one forward of a row (or after several, when frames are thinned)."""

    forward: int  # 1-based: the canvas after this many forwards of the row
    record: StepRecord  # the last forward folded into this frame
    changes: dict[int, Cell] = field(default_factory=dict)  # position -> its cell after the frame
    commits: int = 0
    edits: int = 0
    remasks: int = 0
    inserts: int = 0
    deletes: int = 0
    post: bool = False  # any folded forward was a post step
    verified: bool = False
    window: tuple[int, int] = (0, 0)  # [lo, hi) of the last forward's window
    block: tuple[int, int] = (0, 0)  # [lo, hi) of the last forward's active block
    marks: dict[str, list[int]] = field(default_factory=dict)  # the last forward's hook marks (StepRecord.marks)


def initial_cells(prompt: list[int], length: int, mask_token_id: int) -> list[Cell]:
    """The canvas before the first forward."""
    return [Cell(t, PROMPT) for t in prompt] + [Cell(mask_token_id, MASKED) for _ in range(length - len(prompt))]


def apply_step(cells: list[Cell], s: StepRecord, mask_token_id: int) -> None:
    """Write one step record into ``cells`` (in place)."""
    at = {p: i for i, p in enumerate(s.positions)}

    def event(p: int, token: int, kind: int) -> Cell:
        i = at.get(p)
        if i is None:
            return Cell(token, kind)
        ru = s.runner_up[i] if i < len(s.runner_up) else -1
        ru_p = s.runner_up_confidence[i] if i < len(s.runner_up_confidence) else -1.0
        return Cell(token, kind, s.confidence[i], ru, ru_p)

    for p in s.commit:
        cells[p] = event(p, s.sampled[at[p]], COMMIT)
    for p in s.edit:
        cells[p] = event(p, s.sampled[at[p]], EDIT)
    for p in s.remask:
        cells[p] = event(p, mask_token_id, REMASK)
    if s.block_lo < 0:
        return
    lo, hi = s.block_lo, s.block_lo + len(s.block_after)
    if s.insert or s.delete:
        before = cells[lo:hi]
        _shift(cells, lo, hi, set(s.insert), set(s.delete), mask_token_id)
        if [c.token for c in cells[lo:hi]] != s.block_after:  # the engine refused the shift (overflow)
            cells[lo:hi] = before
    for p, token in zip(range(lo, hi), s.block_after):
        if cells[p].token != token:  # block_after is the truth; a shift we could not follow keeps its kind
            cells[p] = Cell(token, cells[p].kind)


def _shift(cells: list[Cell], lo: int, hi: int, insert: set[int], delete: set[int], mask_token_id: int) -> None:
    """Move the cells of ``[lo, hi)`` as an insert/delete edit moves their tokens
    (:func:`dlm_toolkit.hooks.indel.shift_block`): a mask enters before each inserted position, each
    deleted position leaves (the token that closes the gap is marked ``delete``), the block's
    tail fills with masks."""
    size = hi - lo
    new: list[Cell | None] = [None] * size
    inserted = deleted = 0
    gap = False
    for j, cell in enumerate(cells[lo:hi]):
        p = lo + j
        inserted += p in insert
        target = j + inserted - deleted
        if p in insert and 0 <= target - 1 < size:
            new[target - 1] = Cell(mask_token_id, INSERT)
        if p in delete:
            deleted += 1
            gap = True
            continue
        if target < size:
            new[target] = Cell(**vars(cell))
            if gap:
                new[target].kind = DELETE  # type: ignore[union-attr]
                gap = False
    cells[lo:hi] = [c if c is not None else Cell(mask_token_id, MASKED) for c in new]


def row_frames(trajectory: Trajectory, row: int, every: int = 1) -> tuple[list[Cell], list[Frame]]:
    """``(initial cells, frames)`` of one row: frame k holds the changes of forwards
    ``(k-1)*every+1 .. k*every`` (the last frame ends at the row's last forward)."""
    canvas = trajectory.canvases[row]
    cells = initial_cells(canvas.prompt, canvas.length, trajectory.mask_token_id)
    start = [c.key() for c in cells]
    steps = trajectory.for_row(row)
    frames: list[Frame] = []
    before = list(start)
    frame: Frame | None = None
    for n, s in enumerate(steps, 1):
        if frame is None:
            frame = Frame(n, s)
            before = [c.key() for c in cells]
        apply_step(cells, s, trajectory.mask_token_id)
        frame.forward, frame.record = n, s
        frame.commits += len(s.commit)
        frame.edits += len(s.edit)
        frame.remasks += len(s.remask)
        frame.inserts += len(s.insert)
        frame.deletes += len(s.delete)
        frame.post |= s.post
        frame.verified |= s.verified
        frame.window = (min(s.positions), max(s.positions) + 1) if s.positions else (0, 0)
        frame.block = (s.block_lo, s.block_lo + len(s.block_after)) if s.block_lo >= 0 else frame.window
        frame.marks = s.marks
        if n % every == 0 or n == len(steps):
            frame.changes = {p: Cell(**vars(c)) for p, c in enumerate(cells) if c.key() != before[p]}
            frames.append(frame)
            frame = None
    return [Cell(*k) for k in start], frames
