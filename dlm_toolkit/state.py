"""All per-decode state, and the result a decode returns.

Rows of a batch move independently: each has its own active block, post-step counter, KV-cache
length and counters, so a batch gives row for row what decoding each prompt alone gives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from dlm_toolkit.config import ConfigError

if TYPE_CHECKING:
    from dlm_toolkit.strategy import BlockSchedule


@dataclass
class DecodeState:
    """Mutable state of one (batched) decode. Built by :meth:`start`; read by rules via
    :class:`~dlm_toolkit.strategy.StepContext`; updated by the engine and the block schedule."""

    canvas: torch.Tensor  # (N, Lmax) long: prompt ++ generated positions
    prompt_len: torch.Tensor  # (N,)
    gen_end: torch.Tensor  # (N,) prompt_len + gen_length: output ends here
    length: torch.Tensor  # (N,) canvas length of each row (origin + num_blocks * block_length)
    origin: torch.Tensor  # (N,) absolute position where block 0 starts (blocks align there)
    num_blocks: torch.Tensor  # (N,)
    block_length: int
    mask_token_id: int
    eos_token_id: int
    generator: torch.Generator
    block: torch.Tensor  # (N,) active block
    post: torch.Tensor  # (N,) post-step counter of the active block
    block_step: torch.Tensor  # (N,) forwards in the active block
    block_masked_start: torch.Tensor  # (N,) masked positions of the active block when it began
    block_masked: torch.Tensor  # (N,) masked positions of the active block now
    done: torch.Tensor  # (N,) bool
    eos_stopped: torch.Tensor  # (N,) bool: stopped early at an EOS
    written_step: torch.Tensor  # (N, Lmax) long, -1 where never written
    written_conf: torch.Tensor  # (N, Lmax) float32
    cache: Any = None
    cache_len: torch.Tensor | None = None  # (N,) absolute positions held in the KV cache
    memory: dict[str, Any] = field(default_factory=dict)
    counts: torch.Tensor = None  # type: ignore[assignment]  # (N, len(COUNTERS)) long
    forward_calls: int = 0
    model_time: float = 0.0

    @classmethod
    def start(
        cls,
        prompts: Sequence[Sequence[int]],
        gen_length: int,
        schedule: BlockSchedule,
        mask_token_id: int,
        eos_token_id: int,
        vocab_size: int,
        seed: int | None,
    ) -> DecodeState:
        """A fresh canvas per prompt, laid out by ``schedule``; validates prompts and ``gen_length``."""
        validate_prompts(prompts, gen_length, mask_token_id, vocab_size)
        block_length = schedule.block_length
        n = len(prompts)
        prompt_len = torch.tensor([len(p) for p in prompts])
        origin, first_block, num_blocks = schedule.layout(prompt_len, gen_length)
        length = origin + num_blocks * block_length
        lmax = int(length.max())
        canvas = torch.full((n, lmax), mask_token_id, dtype=torch.long)
        for r, p in enumerate(prompts):
            canvas[r, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        zeros = torch.zeros(n, dtype=torch.long)
        gen = torch.Generator().manual_seed(0 if seed is None else seed)
        state = cls(
            canvas=canvas,
            prompt_len=prompt_len,
            gen_end=prompt_len + gen_length,
            length=length,
            origin=origin,
            num_blocks=num_blocks,
            block_length=block_length,
            mask_token_id=mask_token_id,
            eos_token_id=eos_token_id,
            generator=gen,
            block=first_block.clone(),
            post=zeros.clone(),
            block_step=zeros.clone(),
            block_masked_start=zeros.clone(),
            block_masked=zeros.clone(),
            done=torch.zeros(n, dtype=torch.bool),
            eos_stopped=torch.zeros(n, dtype=torch.bool),
            written_step=torch.full((n, lmax), -1, dtype=torch.long),
            written_conf=torch.zeros(n, lmax),
        )
        state.counts = torch.zeros(n, len(COUNTERS), dtype=torch.long)
        state.block_masked_start = state.masked_in_block(torch.arange(n))
        state.block_masked = state.block_masked_start.clone()
        return state

    @property
    def batch_size(self) -> int:
        return self.canvas.shape[0]

    @property
    def nfe(self) -> torch.Tensor:
        """(N,) forwards each row took part in (a view of ``counts``)."""
        return self.counts[:, 0]

    def block_bounds(self, rows: torch.Tensor, block: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute ``[lo, hi)`` of ``block`` (default: the active block) for ``rows``."""
        b = self.block[rows] if block is None else block
        lo = self.origin[rows] + b * self.block_length
        return lo, lo + self.block_length

    def masked_in_block(self, rows: torch.Tensor) -> torch.Tensor:
        """(R,) number of masked positions in the active block of each row, counted on the canvas
        (the engine keeps ``block_masked`` up to date without recounting)."""
        lo, _ = self.block_bounds(rows)
        idx = (lo[:, None] + torch.arange(self.block_length)).clamp(max=self.canvas.shape[1] - 1)  # (R, Bl)
        return (self.canvas[rows[:, None], idx] == self.mask_token_id).sum(1)

    def generated_span(self, rows: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """(R, Lmax) bool: positions ``[prompt_len, hi)`` of each row."""
        pos = torch.arange(self.canvas.shape[1])
        return (pos >= self.prompt_len[rows, None]) & (pos < hi[:, None])

    def advance_block(self, rows: torch.Tensor, eos_early_stop: bool) -> None:
        """End the active block of ``rows``: stop at EOS if asked, else move to the next block."""
        if rows.numel() == 0:
            return
        if eos_early_stop:
            _, hi = self.block_bounds(rows)
            span = self.generated_span(rows, hi)
            canvas = self.canvas[rows]
            no_mask = ~((canvas == self.mask_token_id) & span).any(1)
            has_eos = ((canvas == self.eos_token_id) & span).any(1)
            stop = no_mask & has_eos
            self.eos_stopped[rows[stop]] = True
            self.done[rows[stop]] = True
            rows = rows[~stop]
        self.block[rows] += 1
        finished = self.block[rows] >= self.num_blocks[rows]
        self.done[rows[finished]] = True
        rows = rows[~finished]
        self.post[rows] = 0
        self.block_step[rows] = 0
        self.block_masked_start[rows] = self.masked_in_block(rows)
        self.block_masked[rows] = self.block_masked_start[rows]

    def result(self, wall_time: float) -> DecodeResult:
        rows = []
        for r in range(self.batch_size):
            p, end = int(self.prompt_len[r]), int(self.gen_end[r])
            out = self.canvas[r, p:end].tolist()
            if self.eos_token_id in out:
                out = out[: out.index(self.eos_token_id) + 1]
            counts = dict(zip(COUNTERS, self.counts[r].tolist()))
            rows.append(
                RowResult(
                    tokens=out,
                    tpf=len(out) / max(counts["nfe"], 1),
                    eos_stopped=bool(self.eos_stopped[r]),
                    **counts,
                )
            )
        n_tokens = sum(len(r.tokens) for r in rows)
        return DecodeResult(
            rows=rows,
            wall_time=wall_time,
            model_time=self.model_time,
            forward_calls=self.forward_calls,
            tokens_per_second=n_tokens / wall_time if wall_time > 0 else float("inf"),
            canvas=self.canvas.clone(),
        )


COUNTERS = (  # columns of DecodeState.counts, in this order
    "nfe",
    "commits",
    "edits",
    "remasks",
    "multi_commit_steps",
    "post_forwards",
    "post_forwards_with_edit",
    "blocks_decoded",
    "forward_tokens",
)


@dataclass
class RowResult:
    """One prompt's output and statistics.

    ``tokens`` are the generated ids cut after the first EOS (EOS kept). ``tpf`` counts those
    tokens (up to and including the first EOS) per forward this row took part in.
    ``forward_tokens`` counts every token position the model processed for this row (a compute
    measure: windows, re-forwarded edit blocks, prefills).
    """

    tokens: list[int]
    nfe: int
    tpf: float
    commits: int
    edits: int
    remasks: int
    multi_commit_steps: int
    post_forwards: int
    post_forwards_with_edit: int
    blocks_decoded: int
    forward_tokens: int
    eos_stopped: bool

    @property
    def edits_per_token(self) -> float:
        return self.edits / max(len(self.tokens), 1)


@dataclass
class DecodeResult:
    """What :func:`~dlm_toolkit.decode.decode` returns. ``tokens_per_second`` counts generated
    tokens up to and including each row's first EOS over the whole wall time."""

    rows: list[RowResult]
    wall_time: float
    model_time: float
    forward_calls: int
    tokens_per_second: float
    canvas: torch.Tensor
    trajectory: Any = None

    @property
    def tokens(self) -> list[list[int]]:
        return [r.tokens for r in self.rows]

    def summary(self) -> dict[str, Any]:
        """Batch means and totals as plain numbers (for JSON, MLflow metrics)."""
        n = len(self.rows)
        gen = sum(len(r.tokens) for r in self.rows)
        nfe = sum(r.nfe for r in self.rows)
        return {
            "n": n,
            "nfe_mean": nfe / n,
            "tpf": gen / max(nfe, 1),
            "edits_per_token": sum(r.edits for r in self.rows) / max(gen, 1),
            "remasks_per_token": sum(r.remasks for r in self.rows) / max(gen, 1),
            "generated_tokens": gen,
            "forward_calls": self.forward_calls,
            "wall_time_s": self.wall_time,
            "model_time_s": self.model_time,
            "tokens_per_second": self.tokens_per_second,
        }

    def row_dict(self, i: int) -> dict[str, Any]:
        d = asdict(self.rows[i])
        d["edits_per_token"] = self.rows[i].edits_per_token
        return d


def validate_prompts(prompts: Sequence[Sequence[int]], gen_length: int, mask_token_id: int, vocab_size: int) -> None:
    """Clear errors for what a decode cannot start from."""
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or gen_length <= 0:
        raise ConfigError(f"gen_length: must be an integer >= 1 (got {gen_length!r})")
    if len(prompts) == 0:
        raise ConfigError("prompts: need at least one prompt")
    for r, p in enumerate(prompts):
        if len(p) == 0:
            raise ConfigError(f"prompt {r}: empty prompt (a decode needs at least one prompt token)")
        bad = [t for t in p if not (0 <= int(t) < vocab_size)]
        if bad:
            raise ConfigError(f"prompt {r}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
        if mask_token_id in p:
            raise ConfigError(f"prompt {r}: contains the mask token id {mask_token_id}")
