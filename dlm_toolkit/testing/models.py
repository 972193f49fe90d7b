"""Tiny randomly initialised LLaDA2 MoE models for tests and examples (milliseconds per forward)."""

from __future__ import annotations

from typing import Any

import torch

from dlm_toolkit.models import LLaDA2Config, LLaDA2MoeModelLM


def tiny_llada2_config(**overrides: Any) -> LLaDA2Config:
    """A valid LLaDA2 config of the real architecture at toy size (vocab 64, mask 63, EOS 62)."""
    fields: dict[str, Any] = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=512,
        mask_token_id=63, eos_token_id=62,
    )
    return LLaDA2Config(**(fields | overrides))


def tiny_llada2(seed: int = 0, logit_scale: float = 30.0, keep_mask_row: bool = False, **overrides: Any) -> LLaDA2MoeModelLM:
    """A seeded random tiny model whose confidences spread over (0, 1) like a trained one's.

    The ``lm_head`` is scaled by ``logit_scale`` (a plain N(0, 0.02) init gives near-uniform
    softmaxes, where every step is a fallback) and the expert bias is random so it changes routing.
    The mask row is zeroed (the mask token is then rarely the argmax, yet still takes its share of
    every softmax) unless ``keep_mask_row``: then it is a random row like any other, so the mask
    token is sometimes the argmax, as in a degenerate model.
    """
    model = LLaDA2MoeModelLM(tiny_llada2_config(**overrides)).init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        if not keep_mask_row:
            model.lm_head.weight[model.mask_token_id].zero_()
        for name, p in model.named_buffers():  # expert_bias is a buffer, not a parameter
            if name.endswith("expert_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()
