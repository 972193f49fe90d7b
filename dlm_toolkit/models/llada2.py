"""LLaDA2 MoE (``model_type: llada2_moe``), the native block-diffusion model: the decoder layer and
the model, read top to bottom. The parts live by concern: config and tensor parallelism in
:mod:`.llada2_config`, norms/RoPE/KV cache/attention/dense MLP in :mod:`.layers`, the router and
the experts in :mod:`.moe`; every name stays importable from here. ``state_dict()`` keys are the keys of the released
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

import torch
from torch import nn

from .layers import MLP, Attention, KVCache, RMSNorm, Rope, apply_partial_rope, rope_cos_sin
from .llada2_config import OFFICIAL_CONFIG_DEFAULTS, SINGLE, LLaDA2Config, TensorParallel, shard_problems
from .moe import PROJECTIONS, Experts, MoE, MoEImpl, Router, combine_pairs, grouped_mm_supported

__all__ = [
    "OFFICIAL_CONFIG_DEFAULTS", "PROJECTIONS", "SINGLE", "Attention", "DecoderLayer", "Experts", "KVCache",
    "LLaDA2Backbone", "LLaDA2Config", "LLaDA2MoeModelLM", "MLP", "MoE", "MoEImpl", "RMSNorm", "Rope", "Router",
    "TensorParallel", "apply_partial_rope", "combine_pairs", "grouped_mm_supported", "rope_cos_sin",
    "shard_problems",
]

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

    def forward(self, h, rope, mask, cache_kv, cache_rows, write_pos, trace, no_keys=None):
        attn = self.attention(self.input_layernorm(h), rope, mask, cache_kv, cache_rows, write_pos, no_keys)
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
        """Run every MoE layer with ``"grouped"`` (one grouped GEMM for gate and up, one for down) or
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
        shape = (batch_size, 2 * (kv_hi - kv_lo), max_length + 1, cfg.head_dim)  # K|V heads, + the spare slot
        return KVCache([torch.zeros(shape, dtype=self.dtype, device=dev) for _ in range(cfg.num_hidden_layers)])

    def forward_window(self, input_ids, position_ids, attn_mask, cache=None, cache_rows=None, cache_write=None,
                       return_intermediates: bool = False):
        """Logits (B, T, V) float32 for a window; see ``DiffusionLM.forward_window``.

        With ``return_intermediates`` also returns a dict with ``embeddings``, ``layer_out.{i}``,
        ``final_norm`` and, per MoE layer, ``router_logits.{i}``, ``router_topk_idx.{i}``,
        ``router_topk_weight.{i}`` (the names of the conformance fixture).

        Reads nothing back to the host (the checks here look at shapes only, which are Python
        ints), so with fixed shapes it can be captured in a CUDA graph or compiled with
        ``fullgraph=True``; the ``"reference"`` MoE path is the exception (it reads the counts).
        Written positions must be below ``cache.max_length`` (not checked: that would be a host
        read); ``cache.max_length`` itself is the spare slot.
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
        if cache_rows is not None and cache_rows.shape != (B,):
            raise ValueError(f"cache_rows must have shape ({B},), got {tuple(cache_rows.shape)}")
        if cache_write is not None and (cache_write.dtype != torch.bool or cache_write.shape != (B, T)):
            raise ValueError(f"cache_write must be bool of shape ({B}, {T}), "
                             f"got {cache_write.dtype} {tuple(cache_write.shape)}")
        if cache is not None and S > cache.max_length:
            raise ValueError(f"attn_mask has S={S} cache columns but the cache holds {cache.max_length} positions")

        # Entries not written go to the cache's spare slot: a fixed-shape write, no host read.
        write_pos = None if cache_write is None else torch.where(cache_write, position_ids, cache.max_length)
        trace = {} if return_intermediates else None
        cfg = self.config
        rope = Rope.build(position_ids, cfg.rotary_dim, cfg.head_dim, cfg.rope_theta, self.dtype)
        allowed = attn_mask[:, None]  # (B, 1, T, S+T), broadcast over heads
        no_keys = ~allowed.any(-1, keepdim=True)  # (B, 1, T, 1) padding queries, once for all layers
        # the additive form SDPA would build from the bool mask in every layer (same values: 0 / -inf;
        # `where` of two Python floats gives the default dtype, so the model's dtype is asked for)
        mask = torch.where(allowed, 0.0, float("-inf")).to(self.dtype)
        h = self.model.word_embeddings(input_ids)  # (B, T, H)
        if trace is not None:
            trace["embeddings"] = h
        for i, layer in enumerate(self.model.layers):
            cache_kv = cache.kv[i] if cache is not None else None
            h = layer(h, rope, mask, cache_kv, cache_rows, write_pos, trace, no_keys)
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
