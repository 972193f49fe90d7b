"""LLaDA2 MoE (``model_type: llada2_moe``), the native block-diffusion model, in one file.

Read top to bottom: config, norms and RoPE, attention (with the prefix KV cache), the dense
SwiGLU MLP, the MoE layer (router + experts grouped by expert), the decoder layer and the model.
Parameter names follow the official checkpoints exactly, so ``state_dict()`` keys are the keys of
the released ``model.safetensors`` files (see DESIGN.md §3 and the conformance README).

Shapes: B batch, T window length, S cached prefix length, H hidden, nq/nkv query/KV heads,
D head_dim, R rotary dims, E experts, K experts per token, N tokens (B*T), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
        """Official key names plus every extra key this config was read with (for config.json)."""
        d = self.model_dump()
        for name in ("mask_token_id", "eos_token_id"):
            if d[name] is None:
                del d[name]
        return d


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
    def __init__(self, cfg: LLaDA2Config, dtype: torch.dtype):
        super().__init__()
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_out = (self.nq + 2 * self.nkv) * self.hd  # packed [all Q heads | all K heads | all V heads]
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


class MLP(nn.Module):
    """SwiGLU without biases: the dense layers, every routed expert and the shared expert."""

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


class MoE(nn.Module):
    """Routed experts (grouped by expert: one matmul chain per expert that received tokens) plus
    an always-on shared expert. Experts are separate modules so that their parameters carry the
    official per-expert names; the grouping makes the per-expert loop cost O(active experts)."""

    def __init__(self, cfg: LLaDA2Config, dtype: torch.dtype):
        super().__init__()
        self.gate = Router(cfg)
        H, inner = cfg.hidden_size, cfg.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(H, inner, dtype) for _ in range(cfg.num_experts))
        self.shared_experts = MLP(H, inner * cfg.num_shared_experts, dtype) if cfg.num_shared_experts else None

    def forward(self, x: torch.Tensor, trace: dict | None = None, layer: int = 0) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # (N, H)
        logits, idx, weight = self.gate(flat)
        if trace is not None:
            trace[f"router_logits.{layer}"] = logits.view(B, T, -1)
            trace[f"router_topk_idx.{layer}"] = idx.view(B, T, -1)
            trace[f"router_topk_weight.{layer}"] = weight.view(B, T, -1)
        y = moe_forward_grouped(self.experts, flat, idx, weight)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return y.view(B, T, H)


def moe_forward_grouped(experts: nn.ModuleList, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor):
    """sum_k weight[n, k] * experts[idx[n, k]](x[n]) by sorting the N*K (token, expert) pairs by
    expert, so each active expert runs once on a contiguous slice of its tokens."""
    N, K = idx.shape
    order = idx.flatten().argsort()  # (N*K,) pair ids grouped by expert
    token = order // K  # token of each sorted pair
    counts = torch.bincount(idx.flatten(), minlength=len(experts)).tolist()
    xs = x[token]  # (N*K, H) gathered inputs, expert-contiguous
    outs = [experts[e](chunk) for e, chunk in enumerate(xs.split(counts)) if counts[e]]
    out = torch.cat(outs) * weight.flatten()[order, None].to(x.dtype)  # (N*K, H)
    return torch.zeros_like(x).index_add_(0, token, out)


def moe_forward_loop(experts: nn.ModuleList, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor):
    """Naive reference for tests and the benchmark: every expert on every token, masked by a
    dense (N, E) combine weight that is zero where the expert was not chosen."""
    combine = weight.new_zeros(x.shape[0], len(experts)).scatter_(1, idx, weight)  # (N, E)
    y = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        y += combine[:, e : e + 1].to(x.dtype) * expert(x)
    return y


# ----------------------------------------------------------------------------------------------
# Decoder layer and model


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, layer: int, dtype: torch.dtype):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attention = Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        dense = layer < cfg.first_k_dense_replace
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype) if dense else MoE(cfg, dtype)

    def forward(self, h, cos, sin, mask, cache_kv, cache_rows, write_at, trace):
        h = h + self.attention(self.input_layernorm(h), cos, sin, mask, cache_kv, cache_rows, write_at)
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x, trace, self.layer) if isinstance(self.mlp, MoE) else self.mlp(x))


class LLaDA2Backbone(nn.Module):
    def __init__(self, cfg: LLaDA2Config, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LLaDA2MoeModelLM(nn.Module):
    """The LLaDA2 MoE diffusion LM, implementing :class:`dlm_toolkit.models.base.DiffusionLM`.

    Construct from a config (torch's default init, zero router; call :meth:`init_weights` for a
    seeded init; build it under ``torch.device("meta")`` to skip the init and allocate nothing), or
    use :func:`dlm_toolkit.models.checkpoint.load_model`. Parameters require grad as usual, so
    decode under ``torch.inference_mode()``.
    """

    attention = "block_causal"
    supports_kv_cache = True

    def __init__(self, config: LLaDA2Config, dtype: torch.dtype = torch.float32,
                 mask_token_id: int | None = None, eos_token_id: int | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        # Arguments win over the config; -1 marks "unknown" (the loader always resolves real ids,
        # a bare randomly initialised model may not need them).
        self.mask_token_id = next((i for i in (mask_token_id, config.mask_token_id) if i is not None), -1)
        self.eos_token_id = next((i for i in (eos_token_id, config.eos_token_id) if i is not None), -1)
        self.model = LLaDA2Backbone(config, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)

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
        shape = (batch_size, cfg.num_key_value_heads, max_length, cfg.head_dim)
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
