"""Decode-loop speed: exact prefix KV cache vs recomputing the prefix, engine overhead, and the
grouped-GEMM MoE next to the reference per-expert MoE (the same decode with each).

Run: ``python benchmarks/decode_speed.py [--json]``. Model: a random LLaDA2 MoE at small size
(hidden 256, 4 layers, 16 experts top-4, groups 4/2), lm_head scaled so confidences spread like a
trained model's; 512 generated tokens, block 32, preset llada2.1-q, batch 1, fp32 CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_speed import moe_speedup  # noqa: E402

from dlm_toolkit import DecodingPolicy, decode  # noqa: E402
from dlm_toolkit.testing import ScriptedLM, tiny_llada2  # noqa: E402

SMALL = dict(
    vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, intermediate_size=768, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
    n_group=4, topk_group=2, max_position_embeddings=1024, mask_token_id=511, eos_token_id=510,
)


def best_of(repeats: int, fn):
    runs = [fn() for _ in range(repeats)]
    return min(runs, key=lambda r: r.wall_time)


def decode_speed(gen_length: int = 512, block: int = 32, repeats: int = 3, seed: int = 0) -> dict:
    model = tiny_llada2(seed, logit_scale=30.0, **SMALL)
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": block, "blocks.params.eos_early_stop": False})
    prompt = [[(7 * i) % 500 for i in range(40)]]
    decode(model, prompt, policy, 64)  # warm-up
    cached = best_of(repeats, lambda: decode(model, prompt, policy, gen_length, kv_cache=True))
    plain = best_of(repeats, lambda: decode(model, prompt, policy, gen_length, kv_cache=False))
    # the engine alone: a model whose forward costs nothing (a table lookup by position), so the
    # whole wall time is the engine's per-step work (canvas-wide: the scripted model keeps no cache)
    table = torch.randn(1024, SMALL["vocab_size"], generator=torch.Generator().manual_seed(seed)) * 8
    zero = ScriptedLM(lambda ids, pos, attn: table[pos], SMALL["vocab_size"], SMALL["mask_token_id"], SMALL["eos_token_id"])
    free = best_of(repeats, lambda: decode(zero, prompt, policy, gen_length))
    model.set_moe_impl("reference")
    reference = best_of(repeats, lambda: decode(model, prompt, policy, gen_length, kv_cache=True))
    model.set_moe_impl("grouped")
    return {
        "moe_grouped_s": cached.wall_time,
        "moe_reference_s": reference.wall_time,
        "moe_decode_speedup": reference.wall_time / cached.wall_time,
        "moe_tokens_identical": reference.tokens == cached.tokens and reference.rows[0].nfe == cached.rows[0].nfe,
        "gen_length": gen_length,
        "block_length": block,
        "nfe": cached.rows[0].nfe,
        "tpf": cached.rows[0].tpf,
        "cached_s": cached.wall_time,
        "recompute_s": plain.wall_time,
        "kv_speedup": plain.wall_time / cached.wall_time,
        "tokens_identical": cached.tokens == plain.tokens and cached.rows[0].nfe == plain.rows[0].nfe,
        "overhead_fraction": 1.0 - cached.model_time / cached.wall_time,
        "overhead_ms_per_step": 1e3 * (cached.wall_time - cached.model_time) / cached.rows[0].nfe,
        "zero_model_ms_per_step": 1e3 * free.wall_time / free.rows[0].nfe,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = decode_speed(repeats=args.repeats)
    moe = [moe_speedup(tokens=n, repeats=args.repeats) for n in (32, 2048)]
    result["moe_layer_speedup_32_tokens"] = moe[0]["speedup"]
    result["moe_layer_speedup_2048_tokens"] = moe[1]["speedup"]
    result["moe"] = moe
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")


if __name__ == "__main__":
    main()
