"""The LLaDA2 mixture of experts: sigmoid router with group-limited top-k, the routed experts stacked
per layer and run by two grouped GEMMs, gate and up together then down (or the per-expert reference
path), and the always-on shared expert. On a CPU, eager, for large windows the grouped GEMMs run as
one ``mm`` per active expert over chunks of pairs, with the same bits (:meth:`Experts._host_grouped`).

Shapes: N tokens, H hidden, E experts, K experts per token, I expert width.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .layers import MLP
from .llada2_config import SINGLE, LLaDA2Config, TensorParallel

MoEImpl = Literal["grouped", "reference"]


class Router(nn.Module):
    """Sigmoid router with expert bias and group-limited top-k; always float32 (weight and bias)."""

    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.scale = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor):
        """x (N, H) -> router logits (N, E), chosen experts (N, K) by biased score descending,
        their weights (N, K) float32."""
        logits = F.linear(x if x.dtype == torch.float32 else x.float(), self.weight)  # (N, E)
        scores = logits.sigmoid()
        biased = scores + self.expert_bias  # the bias steers selection only, never the weights
        N, E = biased.shape
        if self.topk_group < self.n_group:  # else every group is kept: the group step selects nothing
            grouped = biased.view(N, self.n_group, E // self.n_group)  # (N, G, E/G)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
            keep = group_scores.topk(self.topk_group, dim=-1).indices  # (N, kg)
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)  # (N, G)
            biased = grouped.masked_fill(dropped[..., None], float("-inf")).view(N, E)
        idx = biased.topk(self.k, dim=-1).indices  # (N, K), sorted by biased score
        weight = scores.gather(1, idx)
        if self.k > 1:  # norm_topk_prob: the reference renormalises only when several are chosen
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return logits, idx, weight * self.scale


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` runs for these weights: any float dtype on the
    CPU, bfloat16 on CUDA (the kernel PyTorch ships for GPUs is bf16-only); never on a torch
    older than the function (the reference path runs there)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return device.type == "cuda" and dtype == torch.bfloat16


@torch.library.custom_op("dlm_toolkit::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(a, b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offs)`` for a (M, K) and b (G, K, N). Under ``torch.compile`` it
    goes through an opaque custom op: torch's own fake kernel accepts bfloat16 only (the CUDA
    kernel's rule), which would make a float32 model on the CPU uncompilable; the op runs the same
    kernel, so compiled and eager give the same bits. Eager calls skip the op's dispatch cost."""
    if torch.compiler.is_compiling():
        return _grouped_mm_op(a, b, offs)
    return F.grouped_mm(a, b, offs=offs)


HOST_CHUNK_ROWS = 256  # pairs per chunk of the host path: (256, H) buffers stay in a core's L2
# The host path runs from pairs * hidden >= HOST_MIN_ELEMENTS. Below, it is no faster: one ``mm``
# per active expert either way, and the ~2 us per empty expert that grouped_mm's CPU fallback
# spends is about what the host path's own loop costs. Above, the grouped path's (N*K, H)
# buffers outgrow the cache and the allocator's reuse (fp32, one thread, 256 experts top-8,
# hidden 512: 16384 pairs 1.47x faster, 8192 1.2x, 4096 and fewer the same; mini's layer in
# bf16, hidden 2048: 8192 pairs 1.16x, 2048 1.03x).
HOST_MIN_ELEMENTS = 1 << 22


def _host_pays(x: torch.Tensor, idx: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether :meth:`Experts._host_grouped` runs: the experts' row counts may be read on the
    host and the expert GEMMs run outside ``grouped_mm`` (eager on a CPU: a GPU would wait for the
    device, a compiled graph or a CUDA graph cannot hold a host read; and nothing to differentiate:
    ``torch.mm(out=)`` and the in-place steps have no backward), and the window is large enough
    to gain from it (:data:`HOST_MIN_ELEMENTS`)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or idx.numel() * x.shape[-1] < HOST_MIN_ELEMENTS:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors)))


def _chunks(counts: list[int], rows: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Consecutive experts grouped into chunks of at least ``rows`` pairs (the last may hold
    fewer): (first row, end row, [(expert, its rows)]) per chunk, empty experts left out."""
    chunks, experts, start, end = [], [], 0, 0
    for e, n in enumerate(counts):
        if n:
            experts.append((e, n))
            end += n
            if end - start >= rows:
                chunks.append((start, end, experts))
                experts, start = [], end
    if experts:
        chunks.append((start, end, experts))
    return chunks


def _experts_mm(a: torch.Tensor, b: torch.Tensor, experts: list[tuple[int, int]]) -> torch.Tensor:
    """Rows of ``a`` (M, K), grouped by expert in the order of ``experts`` ((expert, rows) pairs),
    each group times its expert's matrix in ``b`` (E, K, N): one ``mm`` per expert into its slice
    of the output, the call ``grouped_mm``'s CPU fallback makes (a GEMM's bits for a row depend on
    the row count, so each expert keeps its own call)."""
    out = a.new_empty(a.shape[0], b.shape[-1])
    ids, rows = zip(*experts)
    for a_e, out_e, e in zip(a.split(rows), out.split(rows), ids):
        torch.mm(a_e, b[e], out=out_e)
    return out


def _capturing(x: torch.Tensor) -> bool:
    """Whether ``x``'s forward is being traced by ``torch.compile`` or captured in a CUDA graph."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _aligned(t: torch.Tensor, align: int, dims: int = 1) -> torch.Tensor:
    """Zero-pad the last ``dims`` dims to multiples of ``align``: grouped GEMM (forward and
    backward) needs 16-byte aligned strides; zero rows/columns add nothing to any dot product
    and leave zeros in the padded outputs."""
    pad = [p for d in range(1, dims + 1) for p in (0, -t.shape[-d] % align)]
    return F.pad(t, pad) if any(pad) else t


class Experts(nn.Module):
    """The routed experts of one MoE layer, stacked: ``gate_up_proj`` (E, 2I, H), each expert's
    gate rows then its up rows (``gate_proj``/``up_proj`` (E, I, H) are views of it), and
    ``down_proj`` (E, H, I), ``nn.Linear`` layout per expert. Gate and up stacked per expert make
    one grouped GEMM of both (one call and one loop over experts fewer per layer; each output
    column is the same dot product, so the same bits). Holds experts ``first ..
    first + count - 1`` of the layer (all of them on one device, a range per rank under expert
    parallelism).

    ``state_dict()`` names each expert's matrix as the official checkpoints do
    (``{e}.gate_proj.weight``, views into the stacks, no copies) and ``load_state_dict`` accepts
    those names and stacks them, so checkpoints keep the per-expert layout.
    """

    def __init__(self, count: int, hidden: int, inner: int, dtype: torch.dtype, first: int = 0):
        super().__init__()
        self.first, self.count, self.inner = first, count, inner
        bound_in, bound_inner = hidden ** -0.5, inner ** -0.5  # nn.Linear's default init bounds
        gate_up = torch.empty(count, 2 * inner, hidden, dtype=dtype).uniform_(-bound_in, bound_in)
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(torch.empty(count, hidden, inner, dtype=dtype).uniform_(-bound_inner, bound_inner))
        self.register_state_dict_post_hook(_unstack_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    @property
    def gate_proj(self) -> torch.Tensor:
        """(E, I, H) view of the gate rows of ``gate_up_proj``."""
        return self.gate_up_proj[:, :self.inner]

    @property
    def up_proj(self) -> torch.Tensor:
        """(E, I, H) view of the up rows of ``gate_up_proj``."""
        return self.gate_up_proj[:, self.inner:]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, impl: MoEImpl = "grouped",
                sharded: bool = False) -> torch.Tensor:
        """``sum_k weight[n, k] * expert_{idx[n, k]}(x[n])`` over the experts held here.

        x (N, H); idx (N, K) global expert ids; weight (N, K) float32. ``sharded``: some chosen
        experts live on other ranks (their terms are left out here and come with the all-reduce).
        """
        if impl == "grouped" and grouped_mm_supported(x.device, self.gate_proj.dtype):
            if _host_pays(x, idx, weight, self.gate_up_proj, self.down_proj):
                return self._host_grouped(x, idx, weight, sharded)
            return self._grouped(x, idx, weight, sharded)
        if impl == "grouped" and _capturing(x):  # no grouped kernel here (float32 on CUDA)
            return self._dense(x, idx, weight)
        return self._reference(x, idx, weight)

    def _dense(self, x, idx, weight) -> torch.Tensor:
        """Every expert held here on every token, times its routing weight (zero where the token did
        not choose it): fixed shapes and no host read, so a CUDA graph or a compiled graph holds
        it where grouped GEMM does not run. It adds the experts' terms in expert order, as
        :meth:`_reference` does, so the two differ only in how a matmul rounds a batch of rows."""
        slot = idx - self.first  # (N, K) local expert index (others' experts never match)
        y = torch.zeros_like(x)
        for e in range(self.count):
            w = torch.where(slot == e, weight, 0.0).sum(-1)  # (N,) float32
            h = F.silu(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e])
            y = y + F.linear(h, self.down_proj[e]) * w[:, None].to(x.dtype)
        return y

    def _sorted_pairs(self, idx: torch.Tensor, sharded: bool):
        """The (token, expert) pairs sorted by local expert: the sorted local experts (N*K,) (other
        ranks' experts as ``count``, so they sort last), the sorted pair ids (N*K,) and, when
        ``sharded``, which chosen experts (N, K) are held here (else None)."""
        slot = idx - self.first if self.first else idx  # (N, K) local expert index
        mine = None
        if sharded:
            mine = (slot >= 0) & (slot < self.count)
            slot = torch.where(mine, slot, self.count)
        return *slot.flatten().sort(stable=True), mine

    def _padded(self, align: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up (E, 2I', H'), down (E, H', I')): the stacks zero-padded to ``align``, each half
        of gate_up on its own, so the gate columns come out as the separate gate GEMM's."""
        gate_up, H = self.gate_up_proj, self.gate_up_proj.shape[-1]
        if self.inner % align or H % align:
            gate_up = _aligned(gate_up.view(self.count, 2, self.inner, H), align, 2).flatten(1, 2)
        return gate_up, _aligned(self.down_proj, align, 2)

    def _grouped(self, x, idx, weight, sharded: bool) -> torch.Tensor:
        """One grouped GEMM for gate and up (stacked per expert), one for down, over the (token, expert)
        pairs sorted by expert. No loop over experts and no host sync: group boundaries stay on the device as int32 offsets."""
        N, K = idx.shape
        H = x.shape[1]
        slots, order, mine = self._sorted_pairs(idx, sharded)
        ends = torch.arange(1, self.count + 1, device=x.device)
        offs = torch.searchsorted(slots, ends, out_int32=True)  # end of each expert's rows
        token = order // K
        align = 16 // x.element_size()
        xs = _aligned(x.index_select(0, token), align)  # (N*K, H') expert-contiguous inputs
        gate_up, down = self._padded(align)
        inner = gate_up.shape[1] // 2  # I' (padded)
        gate_up = _grouped_mm(xs, gate_up.transpose(-2, -1), offs)  # (N*K, 2I')
        # silu on a contiguous (N*K, I') copy of the gate columns, the shape the separate gate GEMM
        # gave: silu rounds a value differently in its vector loop and its tail or strided loop
        h = F.silu(gate_up[:, :inner].contiguous()) * gate_up[:, inner:]  # (N*K, I')
        out = _grouped_mm(h, down.transpose(-2, -1), offs)
        if out.shape[1] != H:
            out = out[:, :H]
        pair_weight = weight.flatten().index_select(0, order)[:, None]
        out = out * (pair_weight if x.dtype == torch.float32 else pair_weight.to(x.dtype))
        if sharded:  # rows past the last offset are uninitialised memory: select, never multiply
            out = torch.where(mine.flatten()[order, None], out, 0.0)
        return combine_pairs(out, order, K, fixed_order=x.device.type != "cpu", token=token)

    def _host_grouped(self, x, idx, weight, sharded: bool, chunk_rows: int = HOST_CHUNK_ROWS) -> torch.Tensor:
        """:meth:`_grouped`'s result, bit for bit, where the rows per expert are read on the host
        (see :func:`_host_pays`): one ``mm`` per expert that received pairs, the calls
        ``grouped_mm``'s CPU fallback makes for it (that fallback also makes one per empty expert).

        The GEMMs and the weighting run over chunks of about ``chunk_rows`` pairs (whole experts),
        so their inputs and outputs stay in cache instead of filling (N*K, H) buffers; silu runs once
        over the whole (N*K, I') gate buffer, as in :meth:`_grouped`: it rounds a value differently
        in its vector loop and its tail, so its bits depend on the buffer's length. Other ranks'
        pairs sort last and are never computed (the grouped path computes them and selects zero:
        adding +0.0 to a sum that started at +0.0 changes no bit)."""
        N, K = idx.shape
        H = x.shape[1]
        slots, order, _ = self._sorted_pairs(idx, sharded)
        counts = torch.bincount(slots, minlength=self.count + 1)[:self.count].tolist()
        token = order // K
        pair_weight = weight.flatten().index_select(0, order)[:, None]
        pair_weight = pair_weight if x.dtype == torch.float32 else pair_weight.to(x.dtype)
        align = 16 // x.element_size()
        gate_up, down = (w.transpose(-2, -1) for w in self._padded(align))  # (E, H', 2I'), (E, I', H')
        inner = gate_up.shape[-1] // 2
        chunks = _chunks(counts, chunk_rows)
        rows = sum(counts)
        gate, ups = x.new_empty(N * K, inner), []  # other ranks' pairs too: silu's tail falls where it did
        gate[rows:].zero_()
        for start, end, experts in chunks:
            both = _experts_mm(_aligned(x.index_select(0, token[start:end]), align), gate_up, experts)
            gate[start:end] = both[:, :inner]
            ups.append(both[:, inner:])
        F.silu(gate, inplace=True)  # in place: the same kernel, so the same bits
        # index_add_ on a CPU adds in index order, so chunk after chunk adds in the whole sum's
        # order; in bf16/fp16 it adds in float32 and rounds once at the end: so does y here
        y = x.new_zeros(N, H, dtype=torch.float32)
        for (start, end, experts), up in zip(chunks, ups):
            out = _experts_mm(gate[start:end].mul_(up), down, experts)
            out = (out[:, :H] if out.shape[1] != H else out).mul_(pair_weight[start:end])
            y.index_add_(0, token[start:end], out if out.dtype == torch.float32 else out.float())
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _reference(self, x, idx, weight) -> torch.Tensor:
        """The per-expert path the grouped one is tested against: sort pairs by expert, then one
        matmul chain per expert that received tokens (reads the counts on the host)."""
        N, K = idx.shape
        slot = (idx - self.first).flatten()
        order = slot.argsort()  # (N*K,) pair ids grouped by expert
        mine = (slot >= 0) & (slot < self.count)
        counts = torch.bincount(slot[mine], minlength=self.count).tolist()
        start = int((slot < 0).sum())  # other ranks' lower experts sort first
        y = torch.zeros_like(x)
        for e, n in enumerate(counts):
            if n:
                pairs = order[start : start + n]
                xs = x[pairs // K]
                h = F.silu(F.linear(xs, self.gate_proj[e])) * F.linear(xs, self.up_proj[e])
                y.index_add_(0, pairs // K, F.linear(h, self.down_proj[e]) * weight.flatten()[pairs, None].to(x.dtype))
            start += n
        return y


def combine_pairs(out: torch.Tensor, order: torch.Tensor, K: int, fixed_order: bool,
                  token: torch.Tensor | None = None) -> torch.Tensor:
    """Sum the expert outputs ``out`` (N*K, H) of the pairs ``order`` (sorted pair ids) per token.

    ``fixed_order``: gather back to (token, k) order and sum over k, the same bits on every run
    (a GPU's ``index_add_`` adds with atomics in any order); else ``index_add_`` in place (on a
    CPU it is deterministic and avoids a large fresh buffer, whose page faults cost more than
    the sum). ``token``: ``order // K`` where the caller has it already."""
    N, H = out.shape[0] // K, out.shape[1]
    if fixed_order:
        return out[order.argsort()].view(N, K, H).sum(1)
    return out.new_zeros(N, H).index_add_(0, order // K if token is None else token, out)


def _unstack_experts(module: Experts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    gate_up = state_dict.pop(prefix + "gate_up_proj")
    stacks = {"gate_proj": gate_up[:, :module.inner], "up_proj": gate_up[:, module.inner:],
              "down_proj": state_dict.pop(prefix + "down_proj")}
    for i in range(module.count):
        for name in PROJECTIONS:
            state_dict[f"{prefix}{module.first + i}.{name}.weight"] = stacks[name][i]


def _stack_experts(module: Experts, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    keys = {name: [f"{prefix}{module.first + i}.{name}.weight" for i in range(module.count)] for name in PROJECTIONS}
    # a stack whose experts are not all there is left out and reported missing as usual
    if all(k in state_dict for k in keys["gate_proj"] + keys["up_proj"]):
        gate, up = (torch.stack([state_dict.pop(k) for k in keys[name]]) for name in ("gate_proj", "up_proj"))
        state_dict[prefix + "gate_up_proj"] = torch.cat([gate, up], 1)
    if all(k in state_dict for k in keys["down_proj"]):
        state_dict[prefix + "down_proj"] = torch.stack([state_dict.pop(k) for k in keys["down_proj"]])


class MoE(nn.Module):
    """Routed experts (stacked, see :class:`Experts`) plus an always-on shared expert.

    ``impl``: ``"grouped"`` (default; two grouped GEMMs, gate+up and down, where the kernel exists,
    see :func:`grouped_mm_supported`, else the reference, or inside a capture the dense path
    :meth:`Experts._dense`, which reads nothing back to the host; on a CPU, eager and without
    gradients, windows of at least :data:`HOST_MIN_ELEMENTS` pairs x hidden run the same GEMMs per
    active expert after reading the counts, which is free there: :meth:`Experts._host_grouped`) or
    ``"reference"`` (one matmul chain per active expert, after a host sync). Under expert parallelism the router runs on every
    rank (same input, same choice) and each rank adds the terms of its own experts.
    """

    def __init__(self, cfg: LLaDA2Config, dtype: torch.dtype, tp: TensorParallel = SINGLE,
                 impl: MoEImpl = "grouped"):
        super().__init__()
        self.gate = Router(cfg)
        H, inner = cfg.hidden_size, cfg.moe_intermediate_size
        lo, hi = tp.span(cfg.num_experts)
        self.experts = Experts(hi - lo, H, inner, dtype, first=lo)
        shared = inner * cfg.num_shared_experts // tp.world
        self.shared_experts = MLP(H, shared, dtype) if cfg.num_shared_experts else None
        self.sharded = tp.world > 1
        self.impl: MoEImpl = impl

    def forward(self, x: torch.Tensor, trace: dict | None = None, layer: int = 0) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # (N, H)
        logits, idx, weight = self.gate(flat)
        if trace is not None:
            trace[f"router_logits.{layer}"] = logits.view(B, T, -1)
            trace[f"router_topk_idx.{layer}"] = idx.view(B, T, -1)
            trace[f"router_topk_weight.{layer}"] = weight.view(B, T, -1)
        y = self.experts(flat, idx, weight, self.impl, self.sharded)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(B, T, H)
