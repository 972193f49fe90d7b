"""Per-step records of a decode: what was committed, edited and remasked, with confidences."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from dlm_toolkit.step.state import DecodeState
    from dlm_toolkit.step.context import StepContext

# Jupyter's display of a trajectory is drawn by the viewer, a tool far above the step: the step must
# not import it, so the package's top level (dlm_toolkit/__init__.py, imported before any of its
# modules) registers the viewer's renderer here, as IPython registers formatters by type.
_html_renderer: list[Callable[[Trajectory], str]] = []


def register_html_renderer(render: Callable[[Trajectory], str]) -> None:
    """Make ``render(trajectory)`` the HTML that Jupyter shows for a :class:`Trajectory` (the last
    one registered wins)."""
    _html_renderer[:] = [render]


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
    verified: bool = False  # a verification forward ran in this step (one more NFE; dlm_toolkit.hooks.verify)
    insert: list[int] = field(default_factory=list)  # positions a mask was inserted before (dlm_toolkit.hooks.indel)
    delete: list[int] = field(default_factory=list)  # positions whose token was deleted (before the shift)
    block_lo: int = -1  # absolute position where ``block_after`` starts (-1: not recorded)
    # per window position: the likeliest token other than the drawn one, and its probability
    runner_up: list[int] = field(default_factory=list)
    runner_up_confidence: list[float] = field(default_factory=list)
    # per-slot bool outputs of the policy's step hooks other than insert/delete (ctx.hooks), as
    # positions: output name -> positions it marks (a plug-in hook's outputs are recorded too)
    marks: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class RowCanvas:
    """What a viewer needs besides the steps to replay one row: its prompt and canvas length."""

    prompt: list[int]
    length: int  # canvas positions (prompt + whole blocks)


@dataclass
class Trajectory:
    """All :class:`StepRecord` of a decode, in the order the forwards ran."""

    steps: list[StepRecord] = field(default_factory=list)
    n_rows: int = 1 << 62  # rows at and past this index pad a batch bucket: not recorded
    canvases: list[RowCanvas] = field(default_factory=list)  # per row, read once at the first step
    mask_token_id: int = -1
    eos_token_id: int = -1
    block_length: int = 0

    def concat(self, others: list[Trajectory], parts: list[Any]) -> Trajectory:
        """The trajectory of a batch decoded in consecutive slices (``parts``: their results):
        rows renumbered to their index in the whole batch."""
        out = Trajectory(list(self.steps), canvases=list(self.canvases), mask_token_id=self.mask_token_id,
                         eos_token_id=self.eos_token_id, block_length=self.block_length)
        offset = len(parts[0].rows)
        for traj, part in zip(others, parts[1:]):
            out.steps += [replace(s, row=s.row + offset) for s in traj.steps]
            out.canvases += traj.canvases
            offset += len(part.rows)
        return out

    def add(self, ctx: StepContext, state: DecodeState) -> None:
        assert ctx.commit is not None and ctx.edit is not None and ctx.remask is not None
        if not self.canvases:
            self._read_canvases(state)
        lo, hi = state.block_bounds(ctx.rows, ctx.block)
        runner_up, runner_up_p = _runner_up(ctx)
        live = ctx.live.tolist()
        out = ctx.hooks
        verified = out.get("verified").tolist() if out.get("verified") is not None else [False] * len(live)
        none = torch.zeros_like(ctx.valid)
        insert = out.get("insert") if out.get("insert") is not None else none
        delete = out.get("delete") if out.get("delete") is not None else none
        # every other per-slot bool output a hook set (a plug-in's), as positions
        marks = {name: value for name, value in ((n, out.get(n)) for n in out.names()) if name not in ("insert", "delete")
                 and isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.shape == ctx.valid.shape}
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
                    block_lo=int(lo[i]),
                    runner_up=runner_up[i][valid].tolist(),
                    runner_up_confidence=runner_up_p[i][valid].tolist(),
                    marks={name: pos[m[i]].tolist() for name, m in marks.items()},
                )
            )

    def _read_canvases(self, state: DecodeState) -> None:
        """Prompts and canvas lengths of the recorded rows (the prompt never changes, so reading it
        after the first write is exact)."""
        n = min(self.n_rows, state.batch_size)
        lengths, prompt_len = state.length.tolist(), state.prompt_len.tolist()
        canvas = state.canvas[:n].tolist()
        self.canvases = [RowCanvas(canvas[r][: prompt_len[r]], lengths[r]) for r in range(n)]
        self.mask_token_id, self.eos_token_id = state.mask_token_id, state.eos_token_id
        self.block_length = state.block_length

    def _repr_html_(self) -> str | None:
        """Jupyter shows the trajectory as the stepping viewer (:mod:`dlm_toolkit.viewer`, registered
        by ``import dlm_toolkit``; token ids as text: ``viewer.view(trajectory, tokenizer)`` shows the
        tokenizer's text). ``None`` (Jupyter falls back to ``repr``) if no renderer is registered."""
        return _html_renderer[0](self) if _html_renderer else None

    def for_row(self, row: int) -> list[StepRecord]:
        return [s for s in self.steps if s.row == row]

    def to_records(self) -> list[dict[str, Any]]:
        from dataclasses import asdict

        return [asdict(s) for s in self.steps]


def _runner_up(ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W) the likeliest token other than the drawn one and its probability (recording only)."""
    top_p, top = ctx.probs.topk(2, dim=-1)
    first = top[..., 0] != ctx.sampled
    return torch.where(first, top[..., 0], top[..., 1]), torch.where(first, top_p[..., 0], top_p[..., 1])
