"""All per-decode state, and the result a decode returns.

Rows of a batch move independently: each has its own active block, post-step counter, KV-cache
length, counters and random key, so a batch gives row for row what decoding each prompt alone
gives, at any temperature. Every tensor lives on the model's device; per-row updates are masked
writes over the whole batch (``torch.where``), never boolean indexing, so they need no host sync.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, Sequence

import torch

from dlm_toolkit.config import ConfigError



class Layout(Protocol):
    """What :meth:`DecodeState.start` needs of a block schedule (any
    :class:`~dlm_toolkit.strategy.base.BlockSchedule` is one; this module never imports the strategy API,
    which is built on it)."""

    @property
    def block_length(self) -> int: ...

    def layout(self, prompt_len: torch.Tensor, gen_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass
class DecodeState:
    """Mutable state of one (batched) decode. Built by :meth:`start`; read by rules via
    :class:`~dlm_toolkit.strategy.base.StepContext`; updated by the engine and the block schedule."""

    canvas: torch.Tensor  # (N, Lmax) long: prompt ++ generated positions
    prompt_len: torch.Tensor  # (N,)
    gen_end: torch.Tensor  # (N,) prompt_len + gen_length: output ends here
    length: torch.Tensor  # (N,) canvas length of each row (origin + num_blocks * block_length)
    origin: torch.Tensor  # (N,) absolute position where block 0 starts (blocks align there)
    num_blocks: torch.Tensor  # (N,)
    block_length: int
    mask_token_id: int
    eos_token_id: int
    seeds: torch.Tensor  # (N,) long: each row's random key (see :func:`row_seed`, :mod:`dlm_toolkit.step.rng`)
    block: torch.Tensor  # (N,) active block
    post: torch.Tensor  # (N,) post-step counter of the active block
    block_step: torch.Tensor  # (N,) forwards in the active block
    block_masked_start: torch.Tensor  # (N,) masked positions of the active block when it began
    block_masked: torch.Tensor  # (N,) masked positions of the active block now
    done: torch.Tensor  # (N,) bool
    eos_stopped: torch.Tensor  # (N,) bool: stopped early at an EOS
    written_step: torch.Tensor  # (N, Lmax) long, -1 where never written
    written_conf: torch.Tensor  # (N, Lmax) float32
    # Dynamic block schedules (:class:`~dlm_toolkit.hooks.dynamic_blocks.DynamicBlockSchedule`) keep the
    # active block's bounds here as per-row data; ``None``: the fixed layout gives them.
    block_lo: torch.Tensor | None = None  # (N,) absolute start of the active block
    block_hi: torch.Tensor | None = None  # (N,) its end (exclusive)
    block_width: int = 0  # the widest active block a dynamic schedule may propose (its window_width)
    # the device flags set so far (a dlm_toolkit.step.flags.FlagBoard: errors the engine's next host read
    # raises); made by the engine's first read
    flags: Any = None
    cache: Any = None
    cache_len: torch.Tensor | None = None  # (N,) absolute positions held in the KV cache
    memory: dict[str, Any] = field(default_factory=dict)
    counts: torch.Tensor = None  # type: ignore[assignment]  # (N, len(COUNTERS)) long
    forward_calls: int = 0
    model_time: float = 0.0
    # per-decode constants the step reads many times (built once: each arange is one more small op per call)
    _rows: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _offsets: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)
    _block0: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    _indices: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)
    _count_views: tuple[torch.Tensor | None, dict[tuple[int, int | None], torch.Tensor]] = field(
        default_factory=lambda: (None, {}), init=False, repr=False, compare=False)

    @classmethod
    def start(
        cls,
        prompts: Sequence[Sequence[int]],
        gen_length: int,
        schedule: Layout,
        mask_token_id: int,
        eos_token_id: int,
        vocab_size: int,
        seed: int | Sequence[int] | None,
        device: torch.device | str = "cpu",
        round_width: bool = False,
    ) -> DecodeState:
        """A fresh canvas per prompt on ``device``, laid out by ``schedule``; validates prompts,
        ``gen_length`` and ``seed`` (see :func:`row_seeds`). ``round_width``: make the canvas (and
        so the KV buffer) a power of two wide, so that captured steps serve many prompt lengths
        (the columns past every row's ``length`` stay masked and are never decoded)."""
        validate_prompts(prompts, gen_length, mask_token_id, vocab_size)
        seeds = row_seeds(seed, len(prompts))
        device = torch.device(device)
        block_length = schedule.block_length
        n = len(prompts)
        # the layout is host arithmetic on prompt lengths: done on the CPU, then moved once
        cpu = torch.device("cpu")
        prompt_len = torch.tensor([len(p) for p in prompts], device=cpu)
        origin, first_block, num_blocks = schedule.layout(prompt_len, gen_length)
        length = origin + num_blocks * block_length
        lmax = int(length.max())
        if round_width:
            lmax = 1 << (lmax - 1).bit_length()
        canvas = torch.full((n, lmax), mask_token_id, dtype=torch.long, device=cpu)
        for r, p in enumerate(prompts):
            canvas[r, : len(p)] = torch.as_tensor(list(p), dtype=torch.long, device=cpu)
        prompt_len, origin, first_block, num_blocks, length, canvas = (
            t.to(device) for t in (prompt_len, origin, first_block, num_blocks, length, canvas))
        zeros = torch.zeros(n, dtype=torch.long, device=device)
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
            seeds=torch.tensor(seeds, dtype=torch.long, device=device),
            block=first_block.clone(),
            post=zeros.clone(),
            block_step=zeros.clone(),
            block_masked_start=zeros.clone(),
            block_masked=zeros.clone(),
            done=torch.zeros(n, dtype=torch.bool, device=device),
            eos_stopped=torch.zeros(n, dtype=torch.bool, device=device),
            written_step=torch.full((n, lmax), -1, dtype=torch.long, device=device),
            written_conf=torch.zeros(n, lmax, device=device),
        )
        state.counts = torch.zeros(n, len(COUNTERS), dtype=torch.long, device=device)
        state.block_masked_start = state.masked_in_block(state.all_rows)
        state.block_masked = state.block_masked_start.clone()
        return state

    @property
    def batch_size(self) -> int:
        return self.canvas.shape[0]

    @property
    def device(self) -> torch.device:
        return self.canvas.device

    @property
    def all_rows(self) -> torch.Tensor:
        """(N,) every batch row index: one tensor per decode (the batch never changes size), so
        callers may test ``rows is state.all_rows`` to skip indexing by it. Do not write into it."""
        rows = self._rows
        if rows is None or rows.shape[0] != self.batch_size or rows.device != self.device:
            rows = self._rows = torch.arange(self.batch_size, device=self.device)
        return rows

    def offsets(self, width: int) -> torch.Tensor:
        """``arange(width)`` on the decode's device, built once per width (do not write into it)."""
        out = self._offsets.get(width)
        if out is None or out.device != self.device:
            out = self._offsets[width] = torch.arange(width, device=self.device)
        return out

    def index(self, values: tuple[int, ...]) -> torch.Tensor:
        """``tensor(values)`` (long) on the decode's device, built once per tuple (do not write into it)."""
        out = self._indices.get(values)
        if out is None or out.device != self.device:
            out = self._indices[values] = torch.tensor(values, dtype=torch.long, device=self.device)
        return out

    def counts_columns(self, start: int, width: int | None) -> torch.Tensor:
        """``counts[:, start:start + width]`` (``width`` None: the column ``counts[:, start]``), a view
        (writes go to ``counts``) made once per ``counts`` tensor: keyed by the tensor itself, so a
        decode that replaces ``counts`` gets fresh views (each view made is one more small op per call)."""
        of, views = self._count_views
        if of is not self.counts:
            views = {}
            self._count_views = (self.counts, views)
        out = views.get((start, width))
        if out is None:
            out = self.counts[:, start] if width is None else self.counts.narrow(1, start, width)
            views[(start, width)] = out
        return out

    def block0_slots(self) -> torch.Tensor:
        """(N, block_length) the positions of every row's block 0 (``origin + arange``), built once
        per decode (the origin never changes; do not write into it)."""
        of, out = self._block0 if self._block0 is not None else (None, None)
        if of is not self.origin or out is None:  # keyed by the origin tensor itself (one per decode)
            out = self.origin[:, None] + self.offsets(self.block_length)
            self._block0 = (self.origin, out)
        return out

    @property
    def nfe(self) -> torch.Tensor:
        """(N,) forwards each row took part in (a view of ``counts``, made once per ``counts`` tensor)."""
        return self.counts_columns(0, None)

    def block_bounds(self, rows: torch.Tensor, block: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute ``[lo, hi)`` of ``block`` (default: the active block) for ``rows``. Under a
        dynamic schedule (``block_lo`` set) the bounds are data, not a layout: this is always the
        current active block, whatever ``block`` says."""
        if self.block_lo is not None:
            assert self.block_hi is not None
            return self.block_lo[rows], self.block_hi[rows]
        every = rows is self.all_rows  # every row in order: no gathers by rows
        b = (self.block if every else self.block[rows]) if block is None else block
        lo = torch.add(self.origin if every else self.origin[rows], b, alpha=self.block_length)
        return lo, lo + self.block_length

    def masked_in_block(self, rows: torch.Tensor) -> torch.Tensor:
        """(R,) number of masked positions in the active block of each row, counted on the canvas
        (the engine keeps ``block_masked`` up to date without recounting)."""
        if rows is self.all_rows and self.block_lo is None:  # every row, fixed layout: block 0's slots, moved
            idx = torch.add(self.block0_slots(), self.block[:, None], alpha=self.block_length)
            at = self.canvas.gather(1, idx.clamp_(max=self.canvas.shape[1] - 1))
            return (at == self.mask_token_id).sum(1)
        lo, hi = self.block_bounds(rows)
        width = self.block_length if self.block_lo is None else self.block_width
        idx = lo[:, None] + self.offsets(width)  # (R, width)
        clamped = idx.clamp(max=self.canvas.shape[1] - 1)
        # every row in order: a plain gather (an advanced index by rows costs three times as much)
        at = self.canvas.gather(1, clamped) if rows is self.all_rows else self.canvas[rows[:, None], clamped]
        masked = at == self.mask_token_id
        if self.block_lo is not None:  # a dynamic block may be narrower than block_width
            masked &= idx < hi[:, None]
        return masked.sum(1)

    def generated_span(self, rows: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """(R, Lmax) bool: positions ``[prompt_len, hi)`` of each row."""
        pos = self.offsets(self.canvas.shape[1])
        prompt_len = self.prompt_len if rows is self.all_rows else self.prompt_len[rows]
        return (pos >= prompt_len[:, None]) & (pos < hi[:, None])

    def advance_blocks(self, ending: torch.Tensor, eos_early_stop: bool) -> None:
        """End the active block of the rows where ``ending`` ((N,) bool, rows that are not done) holds:
        stop the row at an EOS if asked, else move it to its next block (done after its last one)."""
        rows = self.all_rows
        if eos_early_stop:
            _, hi = self.block_bounds(rows)
            span = self.generated_span(rows, hi)
            has_mask = ((self.canvas == self.mask_token_id) & span).any(1)
            has_eos = ((self.canvas == self.eos_token_id) & span).any(1)
            stop = ending & has_eos & ~has_mask
            self.eos_stopped |= stop
            self.done |= stop
            ending = ending ^ stop  # stopped rows are ending rows
        self.block += ending  # in place: a bool adds as 0/1
        # precondition: a row past its last block is done (this line keeps it), and ``ending`` holds
        # no done row (docstring): so the rows done now are those done before and the finished ones,
        # and the ending rows that are not done are the ones that moved
        self.done |= self.block >= self.num_blocks
        moved = ending > self.done  # on bools a > b is a & ~b
        self.post = self.post.masked_fill(moved, 0)
        self.block_step = self.block_step.masked_fill(moved, 0)
        start = self.masked_in_block(rows)
        self.block_masked_start = torch.where(moved, start, self.block_masked_start)
        self.block_masked = torch.where(moved, start, self.block_masked)

    def result(self, wall_time: float, n_rows: int | None = None) -> DecodeResult:
        """The result of the first ``n_rows`` rows (default all; the rest pad a batch bucket)."""
        n_rows = self.batch_size if n_rows is None else n_rows
        canvas = self.canvas[:n_rows].cpu()  # one transfer of everything the result reads
        prompt_len, gen_end = self.prompt_len.tolist(), self.gen_end.tolist()
        counts_all, eos_stopped = self.counts.tolist(), self.eos_stopped.tolist()
        rows = []
        for r in range(n_rows):
            out = canvas[r, prompt_len[r] : gen_end[r]].tolist()
            if self.eos_token_id in out:
                out = out[: out.index(self.eos_token_id) + 1]
            counts = dict(zip(COUNTERS, counts_all[r]))
            rows.append(
                RowResult(
                    tokens=out,
                    tpf=len(out) / max(counts["nfe"], 1),
                    eos_stopped=eos_stopped[r],
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
            canvas=canvas,
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
    "inserts",  # masks inserted into the active block (dlm_toolkit.hooks.indel)
    "deletes",  # tokens deleted from it
)


@dataclass
class RowResult:
    """One prompt's output and statistics.

    ``tokens`` are the generated ids cut after the first EOS (EOS kept). ``tpf`` counts those
    tokens (up to and including the first EOS) per forward this row took part in.
    ``forward_tokens`` counts every token position the model processed for this row (a compute
    measure: windows, re-forwarded edit blocks, prefills). ``inserts`` / ``deletes`` count the
    insert/delete edits of a T2T rule that makes them (:mod:`dlm_toolkit.hooks.indel`; 0 otherwise).
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
    inserts: int = 0
    deletes: int = 0

    @property
    def edits_per_token(self) -> float:
        return self.edits / max(len(self.tokens), 1)


@dataclass
class DecodeResult:
    """What :func:`~dlm_toolkit.decoding.loop.decode` returns. ``tokens_per_second`` counts generated
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
            "inserts_per_token": sum(r.inserts for r in self.rows) / max(gen, 1),
            "deletes_per_token": sum(r.deletes for r in self.rows) / max(gen, 1),
            "generated_tokens": gen,
            "forward_calls": self.forward_calls,
            "wall_time_s": self.wall_time,
            "model_time_s": self.model_time,
            "tokens_per_second": self.tokens_per_second,
        }

    @classmethod
    def concat(cls, parts: Sequence[DecodeResult], mask_token_id: int) -> DecodeResult:
        """One result from the results of consecutive slices of a batch (times and calls add up;
        canvases are right-padded with the mask token to the widest)."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.canvas.shape[1] for p in parts)
        canvas = torch.cat([torch.nn.functional.pad(p.canvas, (0, width - p.canvas.shape[1]), value=mask_token_id)
                            for p in parts])
        rows = [r for p in parts for r in p.rows]
        wall = sum(p.wall_time for p in parts)
        n_tokens = sum(len(r.tokens) for r in rows)
        trajectories = [p.trajectory for p in parts]
        return cls(rows=rows, wall_time=wall, model_time=sum(p.model_time for p in parts),
                   forward_calls=sum(p.forward_calls for p in parts),
                   tokens_per_second=n_tokens / wall if wall > 0 else float("inf"), canvas=canvas,
                   trajectory=None if trajectories[0] is None else trajectories[0].concat(trajectories[1:], parts))

    def row_dict(self, i: int) -> dict[str, Any]:
        d = asdict(self.rows[i])
        d["edits_per_token"] = self.rows[i].edits_per_token
        return d


def row_seed(seed: int, index: int) -> int:
    """The seed of the random stream of instance ``index`` under ``seed``: a hash of both, so
    streams of different instances are unrelated and do not depend on how rows are batched."""
    digest = hashlib.sha256(f"dlm-toolkit row stream|{seed}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def row_seeds(seed: int | Sequence[int] | None, n: int) -> list[int]:
    """Per-row stream seeds: an int ``seed`` gives row r ``row_seed(seed, r)`` (``None`` means 0); a
    sequence gives each row its own seed as is (e.g. ``[row_seed(s, i) for i in instances]``, so a
    row decodes the same whatever batch it is in)."""
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool)):
        return [row_seed(seed or 0, r) for r in range(n)]
    seeds = list(seed)
    if len(seeds) != n or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"seed: expected an integer or {n} integers (one per prompt), got {seed!r}")
    return seeds


MAX_GEN_LENGTH = 1 << 20  # far past any model's context: a sanity cap checked before any allocation


def validate_prompts(prompts: Sequence[Sequence[int]], gen_length: int, mask_token_id: int, vocab_size: int) -> None:
    """Clear errors for what a decode cannot start from."""
    if isinstance(gen_length, bool) or not isinstance(gen_length, int) or not 0 < gen_length <= MAX_GEN_LENGTH:
        raise ConfigError(f"gen_length: must be an integer in [1, {MAX_GEN_LENGTH}] (got {gen_length!r})")
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
