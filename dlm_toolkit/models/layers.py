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
    """cos/sin tables (B, 1, T, R) for absolute positions, built per call (no buffers, so a meta-device
    init works): the form :func:`apply_partial_rope` reads; the model runs :class:`Rope`, built from
    these."""
    inv_freq = theta ** (torch.arange(0, -rot_dim, -2, dtype=torch.float32, device=position_ids.device) / rot_dim)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, T, R/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, R): NeoX layout, halves repeat
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first R dims of each head; the remaining D - R dims pass through.
    The op-by-op reference :meth:`Rope.apply` is tested against."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]  # (B, h, T, R), (B, h, T, D-R)
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


@dataclass(frozen=True)
class Rope:
    """Partial rotate-half RoPE over whole heads, as three elementwise ops and one copy:
    ``x * cos + swap(x) * sin`` with tables (B, 1, T, D) built once per forward.

    ``swap`` exchanges the two halves of the first R dims and keeps the D - R pass-through dims
    (one ``cat`` of slices, or one ``roll`` when R = D: cheaper than a gather); ``sin`` carries the
    rotate-half sign, so each value is computed as :func:`apply_partial_rope` computes it
    (``x2 * -s == -x2 * s`` exactly); on the pass-through dims ``cos`` is 1 and ``sin`` 0, and
    ``x * 1 + x * 0 == x`` for every finite x (the partner is x itself, so even -0.0 keeps its
    sign). Same bits as the reference, about a third of its ops.
    """

    cos: torch.Tensor  # (B, 1, T, D)
    sin: torch.Tensor  # (B, 1, T, D)
    rot_dim: int  # R: the rotated dims; the halves swapped are [0, R/2) and [R/2, R)

    @classmethod
    def build(cls, position_ids: torch.Tensor, rot_dim: int, head_dim: int, theta: float,
              dtype: torch.dtype) -> Rope:
        # cos/sin on the (B, T, R) tensor exactly as rope_cos_sin: a vectorised cos may round an
        # element differently from the scalar tail loop, so the table's layout stays the same.
        cos, sin = rope_cos_sin(position_ids, rot_dim, theta, dtype)
        if head_dim > rot_dim:  # the pass-through dims: cos 1, sin 0
            cos, sin = F.pad(cos, (0, head_dim - rot_dim), value=1.0), F.pad(sin, (0, head_dim - rot_dim))
        sin[..., :rot_dim // 2].neg_()  # rotate-half's sign, in place: sin is this call's own table
        return cls(cos, sin, rot_dim)

    def swap(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., D) -> the rotate-half partner of each dim: [R/2 .. R-1, 0 .. R/2-1, R .. D-1]."""
        R, half = self.rot_dim, self.rot_dim // 2
        if R == x.shape[-1]:
            return x.roll(half, -1)
        return torch.cat([x[..., half:R], x[..., :half], x[..., R:]], -1)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, h, T, D) -> x with RoPE applied to the first R dims of every head."""
        return x * self.cos + self.swap(x) * self.sin


# ----------------------------------------------------------------------------------------------
# KV cache


@dataclass
class KVCache:
    """Prefix KV cache of finished positions: per layer one tensor (rows, 2 * nkv, max_length + 1, D),
    the K heads then the V heads (the order of the packed projection), so a forward reads the
    prefix of both with one gather and writes the window's entries with one ``index_put_``.
    :attr:`k` and :attr:`v` are views of the two halves.

    Keys are stored after RoPE, at their absolute position. The engine decides which window
    positions are written (``cache_write``) and which cache row each window row uses.

    The last slot (index ``max_length``) is a spare nobody reads: a forward writes every window
    entry of a row at once, the entries not chosen by ``cache_write`` redirected there, so a write
    is one fixed-shape ``index_put_`` that needs no ``nonzero`` (a host read) and can be captured
    in a CUDA graph. Several redirected entries may land on the spare in one write; which one
    wins does not matter. (Writing the old values back instead would race with a chosen entry
    at the same position.)
    """

    kv: list[torch.Tensor]

    @property
    def k(self) -> list[torch.Tensor]:
        """Per layer the keys (rows, nkv, max_length + 1, D), views into :attr:`kv`."""
        return [t[:, :t.shape[1] // 2] for t in self.kv]

    @property
    def v(self) -> list[torch.Tensor]:
        """Per layer the values (rows, nkv, max_length + 1, D), views into :attr:`kv`."""
        return [t[:, t.shape[1] // 2:] for t in self.kv]

    @property
    def batch_size(self) -> int:
        return self.kv[0].shape[0]

    @property
    def max_length(self) -> int:
        return self.kv[0].shape[2] - 1


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

    def forward(self, x, rope: Rope, mask, cache_kv=None, cache_rows=None, write_pos=None, no_keys=None):
        """x (B, T, H); rope: the forward's :class:`Rope` tables; mask (B, 1, T, S+T): bool (True =
        may attend) or its additive float form (0 / -inf, the query dtype; the model converts once
        per forward what SDPA would convert in every layer); cache_kv: one layer's tensor of a
        :class:`KVCache` (rows, 2 * nkv, L + 1, D), or None; no_keys (B, 1, T, 1) bool: queries the
        mask lets see nothing (computed from ``mask`` when None; the model computes it once per
        forward for all layers); cache_rows (B,) long; write_pos (B, T) long: the cache position
        each window entry is stored at (the spare slot for entries not stored, see
        :class:`KVCache`), or None."""
        B, T, _ = x.shape
        nq, nkv = self.nq, self.nkv
        qkv = self.query_key_value(x).view(B, T, nq + 2 * nkv, self.hd).transpose(1, 2)  # (B, heads, T, D)
        qk = rope.apply(self.qk_norm(qkv[:, :nq + nkv]))  # q and k heads normed and rotated together
        q, k = qk.split([nq, nkv], dim=1)  # (B, nq|nkv, T, D)
        v = qkv[:, nq + nkv:]
        S = mask.shape[-1] - T
        if S or write_pos is not None:
            kv = torch.cat([k, v], dim=1)  # (B, 2 nkv, T, D): the window in the cache's layout
            # keys = cached prefix 0..S-1 of each row's cache row, then the window: one gather and one
            # copy for K and V together (SDPA reads the two halves as strided views: same values)
            kv_all = torch.cat([cache_kv[:, :, :S].index_select(0, cache_rows), kv], dim=2) if S else kv
            k_all, v_all = kv_all[:, :nkv], kv_all[:, nkv:]  # (B, nkv, S+T, D) each
        else:
            k_all, v_all = k, v
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)  # (B, nq, T, D)
        # A query with no allowed key (padding) gives NaN on some backends; NaN values would leak
        # into other rows through 0 * NaN in later layers, so such rows output exactly zero.
        if no_keys is None:
            no_keys = ~mask.any(-1, keepdim=True) if mask.dtype == torch.bool else mask.isneginf().all(-1, keepdim=True)
        # in place on SDPA's fresh output, unless autograd keeps it for the backward
        out = out.masked_fill(no_keys, 0.0) if out.requires_grad else out.masked_fill_(no_keys, 0.0)
        if write_pos is not None:  # after the read above: the window's own keys come from kv
            cache_kv[cache_rows[:, None].expand(B, T), :, write_pos] = kv.transpose(1, 2)  # (B, T, 2 nkv, D)
        return self.dense(out.transpose(1, 2).reshape(B, T, nq * self.hd))

    def qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """``query_layernorm`` on the first ``nq`` heads of qk (B, nq + nkv, T, D) and
        ``key_layernorm`` on the rest, as one norm without weight times a per-head weight table
        (the fused kernel computes ``(x * rstd) * w``, so the bits equal two weighted norms)."""
        qn, kn = self.query_layernorm, self.key_layernorm
        D = qk.shape[-1]
        w = torch.cat([qn.weight.expand(self.nq, D), kn.weight.expand(self.nkv, D)])[:, None]  # (heads, 1, D)
        if qk.dtype == torch.float32 and w.dtype == torch.float32:
            return F.rms_norm(qk, (D,), None, qn.eps) * w
        return (F.rms_norm(qk.float(), (D,), None, qn.eps) * w.float()).to(qk.dtype)


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
