"""MoE speed: the reference path (one matmul chain per active expert, after a host sync) vs the
grouped-GEMM path (stacked experts, one ``grouped_mm`` per projection) of the LLaDA2 model.
``grouped_s`` is the default ``"grouped"`` implementation as the model runs it (on a CPU, from
``HOST_MIN_ELEMENTS`` on, its host path: one ``mm`` per active expert over chunks of pairs);
``grouped_mm_s`` always the ``grouped_mm`` path (what a GPU or a compiled graph runs).

Run: ``python benchmarks/moe_speed.py`` (prints JSON). Default shapes: a scaled-down LLaDA2 MoE
layer, 256 experts, top-8, 8 groups keep 4, hidden 512, expert width 128, fp32 on the CPU, at
decode sizes (32 and 256 tokens: one block of 32 at batch 1 and 8) and at a prefill size (2048).

On a GPU: ``python benchmarks/moe_speed.py --device cuda --dims mini`` (bf16, mini's layer: hidden
2048, expert width 512). Each path's error is reported against a float32 run of the reference
path on the same (upcast) weights: ``rel_err_*`` = ‖out − ref‖ / ‖ref‖. ``expert_bytes`` are the
weights of the experts the routing hit (the bytes the layer must read); ``grouped_fraction_of_copy_rate``
is their read rate in the grouped path over the device's measured copy rate (``bound.py``; the
issue-25 target at 32 tokens on a GPU: at least 0.5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import sys
from pathlib import Path

import torch

from dlm_toolkit.models.llada2 import LLaDA2Config, MoE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bound import copy_bandwidth  # noqa: E402

DIMS = {"small": (512, 128), "mini": (2048, 512), "flash": (4096, 1024)}  # hidden, expert width


def _time(fn, repeats: int, device: torch.device) -> float:
    """Median seconds per call (host clock on a CPU; CUDA events around each call on a GPU)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def moe_speedup(tokens: int = 2048, hidden: int = 512, moe_intermediate: int = 128, num_experts: int = 256,
                top_k: int = 8, n_group: int = 8, topk_group: int = 4, repeats: int = 3, seed: int = 0,
                device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Seconds per call of both paths on the same routed input, their ratio and their errors."""
    device = torch.device(device)
    torch.manual_seed(seed)
    cfg = LLaDA2Config(
        vocab_size=16, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
        head_dim=8, intermediate_size=hidden, moe_intermediate_size=moe_intermediate, num_experts=num_experts,
        num_experts_per_tok=top_k, num_shared_experts=1, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5, first_k_dense_replace=0, rms_norm_eps=1e-6, rope_theta=1e4,
        partial_rotary_factor=1.0, max_position_embeddings=tokens,
    )
    with torch.device(device):
        moe = MoE(cfg, dtype)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        x = torch.randn(tokens, hidden, dtype=dtype)
    _, idx, weight = moe.gate(x.float())
    experts = moe.experts
    t_ref = _time(lambda: experts(x, idx, weight, "reference"), repeats, device)
    t_grouped = _time(lambda: experts(x, idx, weight, "grouped"), repeats, device)
    t_grouped_mm = _time(lambda: experts._grouped(x, idx, weight, sharded=False), repeats, device)
    ref = experts(x, idx, weight, "reference").float()
    grouped = experts(x, idx, weight, "grouped").float()
    active = int(idx.unique().numel())
    expert_bytes = active * 3 * hidden * moe_intermediate * experts.gate_proj.element_size()
    exact = experts.float()(x.float(), idx, weight, "reference")  # upcasts the weights in place: last
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "hidden": hidden,
        "moe_intermediate": moe_intermediate, "num_experts": num_experts, "top_k": top_k,
        "groups": f"{n_group}/{topk_group}", "active_experts": active, "expert_bytes": expert_bytes,
        "grouped_fraction_of_copy_rate": expert_bytes / t_grouped / copy_bandwidth(device),
        "threads": torch.get_num_threads(), "reference_s": t_ref, "grouped_s": t_grouped,
        "speedup": t_ref / t_grouped, "grouped_mm_s": t_grouped_mm, "max_abs_diff": (grouped - ref).abs().max().item(),
        "rel_err_reference": ((ref - exact).norm() / exact.norm()).item(),
        "rel_err_grouped": ((grouped - exact).norm() / exact.norm()).item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dims", choices=sorted(DIMS), default="small", help="hidden size and expert width")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 2048])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 on a CPU, 20 on a GPU")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)
    hidden, inner = DIMS[args.dims]
    print(json.dumps([moe_speedup(tokens=n, hidden=hidden, moe_intermediate=inner, device=args.device,
                                  dtype=torch.bfloat16 if cuda else torch.float32,
                                  repeats=args.repeats or (20 if cuda else 3)) for n in args.tokens], indent=2))


if __name__ == "__main__":
    main()
