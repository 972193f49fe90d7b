"""LLaDA2 MoE (``model_type: llada2_moe``), the native block-diffusion model, in one file.

Read top to bottom: config, tensor parallelism, norms and RoPE, attention (with the prefix KV
cache), the dense SwiGLU MLP, the MoE layer (router + stacked experts run by one grouped GEMM per
projection), the decoder layer and the model. ``state_dict()`` keys are the keys of the released
``model.safetensors`` files, per-expert names included (the stacked expert weights are split into
``experts.{e}.{gate,up,down}_proj.weight`` views on the way out and stacked on the way in); the
reference semantics this file must reproduce are in ``conformance/README.md``.

Several devices: built with a :class:`TensorParallel` of ``world`` ranks, each
module holds only its rank's part (attention heads, dense/shared MLP columns then rows, a range of
routed experts) and the decoder layer all-reduces once after attention and once after the MLP/MoE.
Every rank then holds the same hidden states and logits, bit for bit.

Shapes: B batch, T window length, S cached prefix length, H hidden, nq/nkv query/KV heads,
D head_dim, R rotary dims, E experts, K experts per token, N tokens (B*T), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

# ----------------------------------------------------------------------------------------------
# Config


class LLaDA2Config(BaseModel):
    """The fields of an official LLaDA2 ``config.json`` that the model reads.

    Official configs carry ~48 keys; the ones not listed here (``architectures``,
    ``torch_dtype``, dropout rates, ...) are kept as extras (``extra="allow"``) so that saving a
    loaded model writes them back unchanged. ``mask_token_id``/``eos_token_id`` are not in the
    official configs (they come from the tokenizer) but our own checkpoints store them here.
    """

    model_config = ConfigDict(frozen=True, extra="allow", protected_namespaces=())

    model_type: Literal["llada2_moe"] = "llada2_moe"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    num_shared_experts: int = Field(ge=0)
    n_group: int = Field(gt=0)
    topk_group: int = Field(gt=0)
    routed_scaling_factor: float = Field(gt=0)
    first_k_dense_replace: int = Field(ge=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    partial_rotary_factor: float = Field(gt=0, le=1)
    max_position_embeddings: int = Field(gt=0)
    initializer_range: float = Field(default=0.02, gt=0)
    tie_word_embeddings: bool = False
    mask_token_id: int | None = Field(default=None, ge=0)
    eos_token_id: int | None = Field(default=None, ge=0)

    @field_validator("tie_word_embeddings")
    @classmethod
    def _untied(cls, v: bool) -> bool:
        if v:
            raise ValueError("tie_word_embeddings=true is not supported: LLaDA2 has an untied lm_head")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> LLaDA2Config:
        def bad(field: str, msg: str) -> None:
            raise ValueError(f"{field}: {msg}")

        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}")
        if self.num_experts % self.n_group:
            bad("n_group", f"must divide num_experts={self.num_experts}, got {self.n_group}")
        if self.num_experts // self.n_group < 2:
            bad("n_group", f"groups need >= 2 experts (group score = sum of top-2), so n_group must be "
                f"in [1, {self.num_experts // 2}], got {self.n_group}")
        if self.topk_group > self.n_group:
            bad("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
        kept = self.topk_group * (self.num_experts // self.n_group)
        if self.num_experts_per_tok > kept:
            bad("num_experts_per_tok", f"must be in [1, {kept}] (experts in the topk_group kept groups), "
                f"got {self.num_experts_per_tok}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            bad("first_k_dense_replace", f"must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}")
        rot = self.rotary_dim
        if rot < 2 or rot % 2:
            bad("partial_rotary_factor", f"head_dim * partial_rotary_factor = {rot} must be an even number "
                f">= 2 (head_dim={self.head_dim}, partial_rotary_factor={self.partial_rotary_factor})")
        for name in ("mask_token_id", "eos_token_id"):
            tid = getattr(self, name)
            if tid is not None and tid >= self.vocab_size:
                bad(name, f"must be in [0, vocab_size={self.vocab_size}), got {tid}")
        return self

    @property
    def rotary_dim(self) -> int:
        # The reference uses int(head_dim * partial_rotary_factor) and ignores the `rotary_dim` key.
        return int(self.head_dim * self.partial_rotary_factor)

    def to_hf_dict(self) -> dict:
        """The full key set of the released LLaDA2.x ``config.json`` files (so a checkpoint we write
        loads in the reference remote code without extra arguments and with no weight newly
        initialised), every extra key this config was read with, and our special ids.

        Keys our architecture fixes (``use_bias: false``, sigmoid routing, QK-norm, ...) take the
        released values unless the config was read with them; ``pad_token_id`` is the EOS id, as in
        the released models (absent, the reference's padding index defaults to 156892).
        """
        import transformers

        d = self.model_dump()
        for name in ("mask_token_id", "eos_token_id"):
            if d[name] is None:
                del d[name]
        fixed = dict(OFFICIAL_CONFIG_DEFAULTS, rotary_dim=self.rotary_dim, transformers_version=transformers.__version__)
        if self.eos_token_id is not None:
            fixed["pad_token_id"] = self.eos_token_id
        for key, value in fixed.items():
            d.setdefault(key, value)
        return d


OFFICIAL_CONFIG_DEFAULTS: dict[str, Any] = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "attention_dropout": 0.0,
    "embedding_dropout": 0.0, "output_dropout": 0.0, "hidden_act": "silu", "max_window_layers": 28,
    "moe_router_enable_expert_bias": True, "norm_head": False, "norm_softmax": False, "norm_topk_prob": True,
    "output_router_logits": False, "rope_scaling": None, "router_dtype": "fp32", "score_function": "sigmoid",
    "sliding_window": 4096, "use_bias": False, "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False,
    "use_rmsnorm": True, "use_sliding_window": False, "using_split_qkv_in_self_attention": False,
}
"""Released-config keys whose values our architecture fixes (see :meth:`LLaDA2Config.to_hf_dict`)."""


# ----------------------------------------------------------------------------------------------
# Tensor + expert parallelism


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor/expert-parallel group: rank ``rank`` of ``world``.

    ``group`` is the ``torch.distributed`` process group to all-reduce over (``None``: the default
    group). ``world == 1`` is the ordinary single-device model (no communication).
    """

    rank: int = 0
    world: int = 1
    group: Any = None

    def span(self, n: int) -> tuple[int, int]:
        """This rank's contiguous share ``[lo, hi)`` of ``n`` items split evenly (``n % world == 0``)."""
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, n_kv: int) -> tuple[int, int]:
        """KV heads ``[lo, hi)`` of this rank: split when ``world`` divides ``n_kv``, else each head is
        replicated on ``world / n_kv`` consecutive ranks (the ranks whose query heads use it)."""
        if n_kv % self.world == 0:
            return self.span(n_kv)
        lo = self.rank // (self.world // n_kv)
        return lo, lo + 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (``t`` itself on one rank). The sum is taken in float32: each
        partial is then rounded once, as a single device rounds its one matmul output once."""
        if self.world == 1:
            return t
        import torch.distributed as dist

        total = t.float()
        dist.all_reduce(total, group=self.group)
        return total.to(t.dtype)


SINGLE = TensorParallel()


def shard_problems(cfg: LLaDA2Config, world: int) -> list[str]:
    """Why ``cfg`` cannot be split over ``world`` ranks (empty when it can), one line per field."""
    if world < 1:
        return [f"world size must be >= 1, got {world}"]
    out = []

    def need(field: str, n: int) -> None:
        if n % world:
            out.append(f"{field}={n} is not divisible by the world size {world}")

    need("num_attention_heads", cfg.num_attention_heads)
    nkv = cfg.num_key_value_heads
    if nkv % world and world % nkv:
        out.append(f"num_key_value_heads={nkv}: the world size {world} must divide it or be a multiple of it")
    need("num_experts", cfg.num_experts)
    if cfg.first_k_dense_replace:
        need("intermediate_size", cfg.intermediate_size)
    if cfg.num_shared_experts:
        need("moe_intermediate_size * num_shared_experts", cfg.moe_intermediate_size * cfg.num_shared_experts)
    return out


# ----------------------------------------------------------------------------------------------
# Norms and rotary embeddings


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, computed in float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, rot_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for absolute positions, built per call (no buffers, so meta-device init works)."""
    inv_freq = theta ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=position_ids.device) / rot_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, T, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, R): NeoX layout, halves repeat
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R dims of each head; the remaining D - R dims pass through."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]  # (B, h, T, R), (B, h, T, D-R)
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


# ----------------------------------------------------------------------------------------------
# KV cache


@dataclass
class KVCache:
    """Prefix KV cache of finished positions: per layer K and V of shape (rows, nkv, max_length, D).

    Keys are stored after RoPE, at their absolute position. The engine decides which window
    positions are written (``cache_write``) and which cache row each window row uses.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_length(self) -> int:
        return self.k[0].shape[2]


# ----------------------------------------------------------------------------------------------
# Attention


class Attention(nn.Module):
    """GQA attention with per-head q/k RMSNorm and partial RoPE. Under tensor parallelism it holds
    its rank's query heads and the KV heads they use; ``dense`` then gives a partial sum that the
    decoder layer all-reduces."""

    def __init__(self, cfg: LLaDA2Config, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        q_lo, q_hi = tp.span(cfg.num_attention_heads)
        kv_lo, kv_hi = tp.kv_heads(cfg.num_key_value_heads)
        self.nq, self.nkv, self.hd = q_hi - q_lo, kv_hi - kv_lo, cfg.head_dim
        qkv_out = (self.nq + 2 * self.nkv) * self.hd  # packed [Q heads | K heads | V heads] of this rank
        self.query_key_value = nn.Linear(cfg.hidden_size, qkv_out, bias=False, dtype=dtype)
        self.query_layernorm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype)
        self.key_layernorm = RMSNorm(self.hd, cfg.rms_norm_eps, dtype)
        self.dense = nn.Linear(self.nq * self.hd, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x, cos, sin, mask, cache_kv=None, cache_rows=None, write_at=None):
        """x (B, T, H); mask (B, 1, T, S+T) bool; cache_kv = (K, V) of one layer or None;
        write_at = (window rows, window cols, cache rows, positions) of the entries to store."""
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, self.nq + 2 * self.nkv, self.hd).transpose(1, 2)
        q, k, v = qkv.split([self.nq, self.nkv, self.nkv], dim=1)  # (B, nq|nkv|nkv, T, D)
        q = apply_partial_rope(self.query_layernorm(q), cos, sin)
        k = apply_partial_rope(self.key_layernorm(k), cos, sin)
        S = mask.shape[-1] - T
        if S:  # keys = cached prefix 0..S-1, then the window
            k_all = torch.cat([cache_kv[0][cache_rows, :, :S], k], dim=2)  # (B, nkv, S+T, D)
            v_all = torch.cat([cache_kv[1][cache_rows, :, :S], v], dim=2)
        else:
            k_all, v_all = k, v
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)  # (B, nq, T, D)
        # A query with no allowed key (padding) gives NaN on some backends; NaN values would leak
        # into other rows through 0 * NaN in later layers, so such rows output exactly zero.
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
        if write_at is not None:
            bi, ti, rows, pos = write_at
            cache_kv[0][rows, :, pos] = k[bi, :, ti]  # (n, nkv, D)
            cache_kv[1][rows, :, pos] = v[bi, :, ti]
        return self.dense(out.transpose(1, 2).reshape(B, T, self.nq * self.hd))


# ----------------------------------------------------------------------------------------------
# MLPs and mixture of experts

MoEImpl = Literal["grouped", "reference"]


class MLP(nn.Module):
    """SwiGLU without biases: the dense layers and the shared expert. ``inner`` is this rank's
    share of the width (columns of gate/up, rows of down); the output is then a partial sum."""

    def __init__(self, hidden: int, inner: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        logits = F.linear(x.float(), self.weight)  # (N, E)
        scores = logits.sigmoid()
        biased = scores + self.expert_bias  # the bias steers selection only, never the weights
        N, E = biased.shape
        grouped = biased.view(N, self.n_group, E // self.n_group)  # (N, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        keep = group_scores.topk(self.topk_group, dim=-1).indices  # (N, kg)
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        candidates = biased.masked_fill(~group_mask[..., None].expand_as(grouped).reshape(N, E), float("-inf"))
        idx = candidates.topk(self.k, dim=-1).indices  # (N, K), sorted by biased score
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


def _aligned(t: torch.Tensor, align: int, dims: int = 1) -> torch.Tensor:
    """Zero-pad the last ``dims`` dims to multiples of ``align``: grouped GEMM (forward and
    backward) needs 16-byte aligned strides; zero rows/columns add nothing to any dot product
    and leave zeros in the padded outputs."""
    pad = [p for d in range(1, dims + 1) for p in (0, -t.shape[-d] % align)]
    return F.pad(t, pad) if any(pad) else t


class Experts(nn.Module):
    """The routed experts of one MoE layer, stacked: ``gate_proj``/``up_proj`` (E, I, H) and
    ``down_proj`` (E, H, I), ``nn.Linear`` layout per expert. Holds experts ``first ..
    first + count - 1`` of the layer (all of them on one device, a range per rank under expert
    parallelism).

    ``state_dict()`` names each expert's matrix as the official checkpoints do
    (``{e}.gate_proj.weight``, views into the stacks, no copies) and ``load_state_dict`` accepts
    those names and stacks them, so checkpoints keep the per-expert layout.
    """

    def __init__(self, count: int, hidden: int, inner: int, dtype: torch.dtype, first: int = 0):
        super().__init__()
        self.first, self.count = first, count
        bound_in, bound_inner = hidden ** -0.5, inner ** -0.5  # nn.Linear's default init bounds
        self.gate_proj = nn.Parameter(torch.empty(count, inner, hidden, dtype=dtype).uniform_(-bound_in, bound_in))
        self.up_proj = nn.Parameter(torch.empty(count, inner, hidden, dtype=dtype).uniform_(-bound_in, bound_in))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, inner, dtype=dtype).uniform_(-bound_inner, bound_inner))
        self.register_state_dict_post_hook(_unstack_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, impl: MoEImpl = "grouped",
                sharded: bool = False) -> torch.Tensor:
        """``sum_k weight[n, k] * expert_{idx[n, k]}(x[n])`` over the experts held here.

        x (N, H); idx (N, K) global expert ids; weight (N, K) float32. ``sharded``: some chosen
        experts live on other ranks (their terms are left out here and come with the all-reduce).
        """
        if impl == "grouped" and grouped_mm_supported(x.device, self.gate_proj.dtype):
            return self._grouped(x, idx, weight, sharded)
        return self._reference(x, idx, weight)

    def _grouped(self, x, idx, weight, sharded: bool) -> torch.Tensor:
        """One grouped GEMM per projection over the (token, expert) pairs sorted by expert. No
        loop over experts and no host sync: group boundaries stay on the device as int32 offsets."""
        N, K = idx.shape
        H = x.shape[1]
        slot = idx - self.first  # (N, K) local expert index
        if sharded:  # pairs of other ranks' experts sort last, past the final offset (never computed)
            mine = (slot >= 0) & (slot < self.count)
            slot = torch.where(mine, slot, self.count)
        flat = slot.flatten()
        order = flat.argsort(stable=True)  # (N*K,) pairs grouped by expert
        ends = torch.arange(1, self.count + 1, device=x.device)
        offs = torch.searchsorted(flat[order], ends, out_int32=True)  # end of each expert's rows
        token = order // K
        align = 16 // x.element_size()
        xs = _aligned(x[token], align)  # (N*K, H') expert-contiguous inputs
        gate = F.grouped_mm(xs, _aligned(self.gate_proj, align, 2).transpose(-2, -1), offs=offs)  # (N*K, I')
        up = F.grouped_mm(xs, _aligned(self.up_proj, align, 2).transpose(-2, -1), offs=offs)
        down = _aligned(self.down_proj, align, 2).transpose(-2, -1)
        out = F.grouped_mm(F.silu(gate) * up, down, offs=offs)[:, :H]
        out = out * weight.flatten()[order, None].to(x.dtype)
        if sharded:  # rows past the last offset are uninitialised memory: select, never multiply
            out = torch.where(mine.flatten()[order, None], out, 0.0)
        return combine_pairs(out, order, K, fixed_order=x.device.type != "cpu")

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


def combine_pairs(out: torch.Tensor, order: torch.Tensor, K: int, fixed_order: bool) -> torch.Tensor:
    """Sum the expert outputs ``out`` (N*K, H) of the pairs ``order`` (sorted pair ids) per token.

    ``fixed_order``: gather back to (token, k) order and sum over k, the same bits on every run
    (a GPU's ``index_add_`` adds with atomics in any order); else ``index_add_`` in place (on a
    CPU it is deterministic and avoids a large fresh buffer, whose page faults cost more than
    the sum)."""
    N, H = out.shape[0] // K, out.shape[1]
    if fixed_order:
        return out[order.argsort()].view(N, K, H).sum(1)
    return out.new_zeros(N, H).index_add_(0, order // K, out)


def _unstack_experts(module: Experts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    stacks = {name: state_dict.pop(prefix + name) for name in PROJECTIONS}
    for i in range(module.count):
        for name in PROJECTIONS:
            state_dict[f"{prefix}{module.first + i}.{name}.weight"] = stacks[name][i]


def _stack_experts(module: Experts, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    for name in PROJECTIONS:
        keys = [f"{prefix}{module.first + i}.{name}.weight" for i in range(module.count)]
        if all(k in state_dict for k in keys):  # otherwise the missing stack is reported as usual
            state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in keys])


class MoE(nn.Module):
    """Routed experts (stacked, see :class:`Experts`) plus an always-on shared expert.

    ``impl``: ``"grouped"`` (default; one grouped GEMM per projection where the kernel exists,
    see :func:`grouped_mm_supported`, else the reference) or ``"reference"`` (one matmul chain
    per active expert, after a host sync). Under expert parallelism the router runs on every
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


# ----------------------------------------------------------------------------------------------
# Decoder layer and model


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, layer: int, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attention = Attention(cfg, dtype, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        dense = layer < cfg.first_k_dense_replace
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size // tp.world, dtype) if dense else MoE(cfg, dtype, tp)

    def forward(self, h, cos, sin, mask, cache_kv, cache_rows, write_at, trace):
        attn = self.attention(self.input_layernorm(h), cos, sin, mask, cache_kv, cache_rows, write_at)
        h = h + self.tp.all_reduce(attn)
        x = self.post_attention_layernorm(h)
        mlp = self.mlp(x, trace, self.layer) if isinstance(self.mlp, MoE) else self.mlp(x)
        return h + self.tp.all_reduce(mlp)


class LLaDA2Backbone(nn.Module):
    def __init__(self, cfg: LLaDA2Config, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LLaDA2MoeModelLM(nn.Module):
    """The LLaDA2 MoE diffusion LM, implementing :class:`dlm_toolkit.models.base.DiffusionLM`.

    Construct from a config (torch's default init, zero router; call :meth:`init_weights` for a
    seeded init; build it under ``torch.device("meta")`` to skip the init and allocate nothing), or
    use :func:`dlm_toolkit.models.checkpoint.load_model`. Parameters require grad as usual, so
    decode under ``torch.inference_mode()``.

    ``tp``: this process's rank in a tensor/expert-parallel group (default: the whole model here).
    A sharded model holds its rank's slices (see :meth:`checkpoint_slices`); its state dict has the
    official names with this rank's shapes and only its own experts, so it is loaded with
    ``load_model(..., tp=)`` and not saved. ``moe_impl``: see :class:`MoE` and :meth:`set_moe_impl`.
    """

    attention = "block_causal"
    supports_kv_cache = True

    def __init__(self, config: LLaDA2Config, dtype: torch.dtype = torch.float32,
                 mask_token_id: int | None = None, eos_token_id: int | None = None,
                 tp: TensorParallel = SINGLE, moe_impl: MoEImpl = "grouped"):
        super().__init__()
        problems = shard_problems(config, tp.world)
        if problems:
            fits = [w for w in range(1, 65) if not shard_problems(config, w)]
            raise ValueError(f"cannot split the model over {tp.world} ranks: " + "; ".join(problems)
                             + f" (world sizes up to 64 that fit this model: {', '.join(map(str, fits))})")
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.vocab_size = config.vocab_size
        # Arguments win over the config; -1 marks "unknown" (the loader always resolves real ids,
        # a bare randomly initialised model may not need them).
        self.mask_token_id = next((i for i in (mask_token_id, config.mask_token_id) if i is not None), -1)
        self.eos_token_id = next((i for i in (eos_token_id, config.eos_token_id) if i is not None), -1)
        self.model = LLaDA2Backbone(config, dtype, tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.set_moe_impl(moe_impl)

    def set_moe_impl(self, impl: MoEImpl) -> LLaDA2MoeModelLM:
        """Run every MoE layer with ``"grouped"`` (one grouped GEMM per projection) or
        ``"reference"`` (a matmul chain per active expert); both give the same result."""
        if impl not in ("grouped", "reference"):
            raise ValueError(f"moe_impl: must be 'grouped' or 'reference', got {impl!r}")
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.impl = impl
        return self

    def checkpoint_slices(self, key: str) -> list[tuple[slice, ...]]:
        """Which parts of checkpoint tensor ``key`` (a key of this model's ``state_dict()``) this
        rank holds: index tuples into the full tensor whose pieces, concatenated along dim 0, give
        the local tensor. ``[()]`` (everything) on one rank, for replicated tensors and for experts
        (a rank's state dict names only its own experts)."""
        cfg, tp = self.config, self.tp
        if tp.world == 1:
            return [()]
        hd = cfg.head_dim
        if key.endswith("attention.query_key_value.weight"):
            nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
            (q_lo, q_hi), (kv_lo, kv_hi) = tp.span(nq), tp.kv_heads(nkv)
            return [(slice(q_lo * hd, q_hi * hd),), (slice((nq + kv_lo) * hd, (nq + kv_hi) * hd),),
                    (slice((nq + nkv + kv_lo) * hd, (nq + nkv + kv_hi) * hd),)]
        if key.endswith("attention.dense.weight"):
            q_lo, q_hi = tp.span(cfg.num_attention_heads)
            return [(slice(None), slice(q_lo * hd, q_hi * hd))]
        if ".experts." not in key and key.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            dense = ".mlp.shared_experts." not in key
            lo, hi = tp.span(cfg.intermediate_size if dense else cfg.moe_intermediate_size * cfg.num_shared_experts)
            return [(slice(None), slice(lo, hi))] if key.endswith("down_proj.weight") else [(slice(lo, hi),)]
        return [()]

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> LLaDA2MoeModelLM:
        """Random init: N(0, initializer_range) matrices, unit norm weights, zero expert bias."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.state_dict().items():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("expert_bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * self.config.initializer_range)
        return self

    def new_cache(self, batch_size: int, max_length: int) -> KVCache:
        cfg, dev = self.config, self.lm_head.weight.device
        kv_lo, kv_hi = self.tp.kv_heads(cfg.num_key_value_heads)  # this rank's KV heads
        shape = (batch_size, kv_hi - kv_lo, max_length, cfg.head_dim)
        n = cfg.num_hidden_layers
        return KVCache([torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(n)],
                       [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(n)])

    def forward_window(self, input_ids, position_ids, attn_mask, cache=None, cache_rows=None, cache_write=None,
                       return_intermediates: bool = False):
        """Logits (B, T, V) float32 for a window; see ``DiffusionLM.forward_window``.

        With ``return_intermediates`` also returns a dict with ``embeddings``, ``layer_out.{i}``,
        ``final_norm`` and, per MoE layer, ``router_logits.{i}``, ``router_topk_idx.{i}``,
        ``router_topk_weight.{i}`` (the names of the conformance fixture).
        """
        B, T = input_ids.shape
        if position_ids.shape != (B, T):
            raise ValueError(f"position_ids must have shape {(B, T)}, got {tuple(position_ids.shape)}")
        if attn_mask.dtype != torch.bool or attn_mask.dim() != 3 or attn_mask.shape[:2] != (B, T) \
                or attn_mask.shape[2] < T:
            raise ValueError(f"attn_mask must be bool of shape ({B}, {T}, S+{T}), "
                             f"got {attn_mask.dtype} {tuple(attn_mask.shape)}")
        S = attn_mask.shape[2] - T
        if (S or cache_write is not None) and (cache is None or cache_rows is None):
            raise ValueError("a mask with cache columns (S > 0) or cache_write needs cache and cache_rows")
        if cache is not None and S > cache.max_length:
            raise ValueError(f"attn_mask has S={S} cache columns but the cache holds {cache.max_length} positions")

        write_at = None
        if cache_write is not None:
            bi, ti = cache_write.nonzero(as_tuple=True)
            write_at = (bi, ti, cache_rows[bi], position_ids[bi, ti])
        trace = {} if return_intermediates else None
        cos, sin = rope_cos_sin(position_ids, self.config.rotary_dim, self.config.rope_theta, self.dtype)
        mask = attn_mask[:, None]  # (B, 1, T, S+T), broadcast over heads
        h = self.model.word_embeddings(input_ids)  # (B, T, H)
        if trace is not None:
            trace["embeddings"] = h
        for i, layer in enumerate(self.model.layers):
            cache_kv = (cache.k[i], cache.v[i]) if cache is not None else None
            h = layer(h, cos, sin, mask, cache_kv, cache_rows, write_at, trace)
            if trace is not None:
                trace[f"layer_out.{i}"] = h
        h = self.model.norm(h)
        logits = self.lm_head(h).float()  # (B, T, V)
        if trace is not None:
            trace["final_norm"] = h
            return logits, trace
        return logits

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence convenience: positions 0..T-1 and bidirectional attention by default."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if attn_mask is None:
            attn_mask = torch.ones(B, T, T, dtype=torch.bool, device=input_ids.device)
        return self.forward_window(input_ids, position_ids, attn_mask)
