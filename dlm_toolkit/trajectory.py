"""Per-step records of a decode: what was committed, edited and remasked, with confidences."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dlm_toolkit.state import DecodeState
    from dlm_toolkit.strategy import StepContext


@dataclass
class StepRecord:
    """One forward of one batch row. Positions are absolute canvas positions."""

    row: int
    step: int  # the row's forward index (0-based)
    block: int
    masks_before: int  # masked positions in the active block before the forward
    post: bool  # the active block had no mask left (a post step)
    commit: list[int]
    edit: list[int]
    remask: list[int]
    positions: list[int]  # the window
    confidence: list[float]  # per window position, of the drawn token
    sampled: list[int]  # per window position
    block_after: list[int]  # the active block's tokens after the write (and any insert/delete shift)
    verified: bool = False  # a verification forward ran in this step (one more NFE; dlm_toolkit.verify)
    insert: list[int] = field(default_factory=list)  # positions a mask was inserted before (dlm_toolkit.indel)
    delete: list[int] = field(default_factory=list)  # positions whose token was deleted (before the shift)


@dataclass
class Trajectory:
    """All :class:`StepRecord` of a decode, in the order the forwards ran."""

    steps: list[StepRecord] = field(default_factory=list)
    n_rows: int = 1 << 62  # rows at and past this index pad a batch bucket: not recorded

    def concat(self, others: list[Trajectory], parts: list[Any]) -> Trajectory:
        """The trajectory of a batch decoded in consecutive slices (``parts``: their results):
        rows renumbered to their index in the whole batch."""
        out = Trajectory(list(self.steps))
        offset = len(parts[0].rows)
        for traj, part in zip(others, parts[1:]):
            out.steps += [replace(s, row=s.row + offset) for s in traj.steps]
            offset += len(part.rows)
        return out

    def add(self, ctx: StepContext, state: DecodeState) -> None:
        assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
        lo, hi = state.block_bounds(ctx.rows, ctx.block)
        live = ctx.live.tolist()
        verified = ctx.verified.tolist() if ctx.verified is not None else [False] * len(live)
        none = torch.zeros_like(ctx.valid)
        insert = ctx.insert if ctx.insert is not None else none
        delete = ctx.delete if ctx.delete is not None else none
        for i, row in enumerate(ctx.rows.tolist()):
            if not live[i] or row >= self.n_rows:  # not forwarded now, or padding a batch bucket
                continue
            pos = ctx.positions[i]
            valid = ctx.valid[i]
            self.steps.append(
                StepRecord(
                    row=row,
                    step=int(state.nfe[row]) - 1,
                    block=int(ctx.block[i]),
                    masks_before=int(ctx.fillable[i].sum()),
                    post=bool(ctx.post[i]),
                    commit=pos[ctx.commit[i]].tolist(),
                    edit=pos[ctx.edit[i]].tolist(),
                    remask=pos[ctx.remask[i]].tolist(),
                    positions=pos[valid].tolist(),
                    confidence=ctx.confidence[i][valid].tolist(),
                    sampled=ctx.sampled[i][valid].tolist(),
                    block_after=state.canvas[row, int(lo[i]) : int(hi[i])].tolist(),
                    verified=bool(verified[i]),
                    insert=pos[insert[i]].tolist(),
                    delete=pos[delete[i]].tolist(),
                )
            )

    def for_row(self, row: int) -> list[StepRecord]:
        return [s for s in self.steps if s.row == row]

    def to_records(self) -> list[dict[str, Any]]:
        from dataclasses import asdict

        return [asdict(s) for s in self.steps]
