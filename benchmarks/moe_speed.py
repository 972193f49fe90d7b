"""MoE speed: the reference path (one matmul chain per active expert, after a host sync) vs the
grouped-GEMM path (stacked experts, one ``grouped_mm`` per projection) of the LLaDA2 model.

Run: ``python benchmarks/moe_speed.py`` (prints JSON). Shapes: a scaled-down LLaDA2 MoE layer,
256 experts, top-8, 8 groups keep 4, hidden 512, expert width 128, fp32 on the CPU, at decode
sizes (32 and 256 tokens: one block of 32 at batch 1 and 8) and at a prefill size (2048 tokens).
"""

from __future__ import annotations

import json
import time

import torch

from dlm_toolkit.models.llada2 import LLaDA2Config, MoE


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def moe_speedup(tokens: int = 2048, hidden: int = 512, moe_intermediate: int = 128, num_experts: int = 256,
                top_k: int = 8, n_group: int = 8, topk_group: int = 4, repeats: int = 3, seed: int = 0) -> dict:
    """Seconds per call of both paths on the same routed input, their ratio and max difference."""
    torch.manual_seed(seed)
    cfg = LLaDA2Config(
        vocab_size=16, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        head_dim=8, intermediate_size=hidden, moe_intermediate_size=moe_intermediate, num_experts=num_experts,
        num_experts_per_tok=top_k, num_shared_experts=1, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5, first_k_dense_replace=0, rms_norm_eps=1e-6, rope_theta=1e4,
        partial_rotary_factor=1.0, max_position_embeddings=tokens,
    )
    moe = MoE(cfg, torch.float32)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(tokens, hidden)
    _, idx, weight = moe.gate(x)
    experts = moe.experts
    t_ref = _best_time(lambda: experts(x, idx, weight, "reference"), repeats)
    t_grouped = _best_time(lambda: experts(x, idx, weight, "grouped"), repeats)
    diff = (experts(x, idx, weight, "grouped") - experts(x, idx, weight, "reference")).abs().max()
    return {
        "tokens": tokens, "hidden": hidden, "moe_intermediate": moe_intermediate, "num_experts": num_experts,
        "top_k": top_k, "groups": f"{n_group}/{topk_group}", "active_experts": int(idx.unique().numel()),
        "threads": torch.get_num_threads(), "reference_s": t_ref, "grouped_s": t_grouped,
        "speedup": t_ref / t_grouped, "max_abs_diff": diff.item(),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps([moe_speedup(tokens=n) for n in (32, 256, 2048)], indent=2))
