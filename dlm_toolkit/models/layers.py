"""LLaDA2 building blocks other than the MoE: RMSNorm, partial RoPE, the prefix KV cache, GQA
attention and the dense SwiGLU MLP.

Shapes: B batch, T window length, S cached prefix length, H hidden, nq/nkv query/KV heads,
D head_dim, R rotary dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .llada2_config import SINGLE, LLaDA2Config, TensorParallel

# ----------------------------------------------------------------------------------------------
# Norms and rotary embeddings


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, computed in float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel (F.rms_norm) instead of nine small ops; in float32 as the reference.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The op-by-op formula the fused kernel is tested against."""
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
    """Prefix KV cache of finished positions: per layer K and V of shape (rows, nkv, max_length + 1, D).

    Keys are stored after RoPE, at their absolute position. The engine decides which window
    positions are written (``cache_write``) and which cache row each window row uses.

    The last slot (index ``max_length``) is a spare nobody reads: a forward writes every window
    entry of a row at once, the entries not chosen by ``cache_write`` redirected there, so a write
    is one fixed-shape ``index_put_`` that needs no ``nonzero`` (a host read) and can be captured
    in a CUDA graph. Several redirected entries may land on the spare in one write; which one
    wins does not matter. (Writing the old values back instead would race with a chosen entry
    at the same position.)
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_length(self) -> int:
        return self.k[0].shape[2] - 1


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

    def forward(self, x, cos, sin, mask, cache_kv=None, cache_rows=None, write_pos=None, no_keys=None):
        """x (B, T, H); mask (B, 1, T, S+T) bool; cache_kv = (K, V) of one layer or None;
        no_keys (B, 1, T, 1) bool: queries the mask lets see nothing (computed from ``mask`` when
        None; the model computes it once per forward for all layers);
        cache_rows (B,) long; write_pos (B, T) long: the cache position each window entry is
        stored at (the spare slot for entries not stored, see :class:`KVCache`), or None."""
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
        out = out.masked_fill(~mask.any(-1, keepdim=True) if no_keys is None else no_keys, 0.0)
        if write_pos is not None:  # after the read above: the window's own keys come from k, v
            rows = cache_rows[:, None].expand(B, T)
            cache_kv[0][rows, :, write_pos] = k.transpose(1, 2)  # (B, T, nkv, D) at (row, :, pos)
            cache_kv[1][rows, :, write_pos] = v.transpose(1, 2)
        return self.dense(out.transpose(1, 2).reshape(B, T, self.nq * self.hd))


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
