"""benchmarks/bound.py: the weight-read bound's bytes against a hand count from the config, the
experts-hit count against the routing the model reports, and the benchmark's new fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bound  # noqa: E402
import full_scale  # noqa: E402

from dlm_toolkit.models import LLaDA2MoeModelLM  # noqa: E402
from tests.test_model_llada2 import tiny_config  # noqa: E402


@pytest.mark.parametrize("dtype,size", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_weight_bytes_equal_a_hand_count(dtype, size):
    # tiny_config: vocab 32, hidden 32, 2 layers (layer 0 dense MLP 48 wide, layer 1 MoE of 8
    # experts 16 wide + 1 shared 16 wide), heads 4 / kv 2 of dim 8
    model = LLaDA2MoeModelLM(tiny_config(), dtype=dtype)
    H, V, D, nq, nkv = 32, 32, 8, 4, 2
    attention = (H * (nq + 2 * nkv) * D + nq * D * H + 2 * D) * size  # qkv, dense, q/k norms
    norms = 2 * H * size  # input / post-attention norms of a layer
    dense_layer = attention + norms + 3 * H * 48 * size
    router = 8 * H * 4 + 8 * 4  # float32 weight + expert_bias
    moe_layer = attention + norms + router + 3 * H * 16 * size  # + the shared expert
    dense = dense_layer + moe_layer + H * size + V * H * size  # + final norm + lm_head
    per_expert = 3 * 16 * H * size
    got = bound.weight_bytes(model, [5], tokens=7)
    assert got == {"dense": dense, "experts": 5 * per_expert, "embedding": 7 * H * size,
                   "total": dense + 5 * per_expert + 7 * H * size}
    with pytest.raises(ValueError, match=r"hit: one count per MoE layer \(1\), got 2"):
        bound.weight_bytes(model, [1, 2], tokens=1)


def test_experts_hit_is_the_routing_the_model_reports():
    model = LLaDA2MoeModelLM(tiny_config(num_hidden_layers=3), dtype=torch.float32).init_weights(3)
    with torch.no_grad():  # a nonzero router, so tokens spread over the experts
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 1, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(6).expand(2, 6)
    mask = torch.ones(2, 6, 6, dtype=torch.bool)
    with torch.no_grad():
        hit = bound.experts_hit(model, lambda: model.forward_window(ids, pos, mask))
        _, trace = model.forward_window(ids, pos, mask, return_intermediates=True)
    want = [len(set(trace[f"router_topk_idx.{i}"].flatten().tolist())) for i in (1, 2)]
    assert hit == want and all(1 < n <= 8 for n in hit)


def test_copy_bandwidth_is_positive_and_forward_stats_count_ops():
    cpu = torch.device("cpu")
    assert bound.copy_bandwidth(cpu, nbytes=2**20, repeats=1) > 0
    assert bound.copy_rate(10**9, 0.5) == 4e9  # 1 GB read + 1 GB written in half a second
    x = torch.ones(8)
    stats = bound.forward_stats(lambda: (x * 2 + 1).sum(), cpu, iters=2)  # mul, add, sum: 3 outer ops
    assert stats["aten_ops_per_forward"] == 3 and stats["ms_per_forward"] > 0
    assert stats["gpu_busy_fraction"] is None and stats["kernels_per_forward"] is None


def test_full_scale_cpu_smoke_prints_the_bound_fields(capsys):
    torch.set_num_threads(1)
    assert full_scale.main(["--cpu-smoke", "--json", "--batch", "2", "--presets", "Q", "--gen-length", "32",
                            "--layers", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    r = rows[0]
    for key in ("tokens_per_second_graphs", "step_ms_per_forward_graphs", "gpu_busy_fraction",
                "gpu_busy_fraction_graphs", "kernels_per_forward", "fraction_of_bound_graphs"):
        assert r[key] is None, key  # graphs and GPU fields: n/a on a CPU
    assert r["step_ms_per_forward"] > 0 and r["aten_ops_per_forward"] > 50
    assert 0 < r["experts_hit_per_moe_layer"] <= 32 and r["copy_bandwidth_gb_s"] > 0
    assert r["bound_ms_per_forward"] == pytest.approx(1e3 * r["bytes_per_forward"] / (r["copy_bandwidth_gb_s"] * 1e9))
    assert r["fraction_of_bound"] == pytest.approx(r["bound_ms_per_forward"] / r["step_ms_per_forward"])
    # the bytes: the smoke model's hand count (2 layers: one dense, one MoE; fp32) at this routing
    cfg = full_scale.SHAPES["smoke"]
    H, D, V = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    nq, nkv, E, inner = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["moe_intermediate_size"]
    attention = H * (nq + 2 * nkv) * D + nq * D * H + 2 * D + 2 * H
    dense = (2 * attention + 3 * H * cfg["intermediate_size"] + E * H + E + 3 * H * inner + H + V * H) * 4
    experts = r["experts_hit_per_moe_layer"] * 3 * H * inner * 4
    assert r["bytes_per_forward"] == dense + experts + 2 * 32 * H * 4  # + embedding rows of 2 x 32 tokens


def test_moe_speed_reports_expert_bytes_and_their_read_rate():
    import moe_speed

    torch.set_num_threads(1)
    r = moe_speed.moe_speedup(tokens=8, hidden=32, moe_intermediate=16, num_experts=16, top_k=2, n_group=4,
                              topk_group=2, repeats=1)
    assert 2 <= r["active_experts"] <= 16
    assert r["expert_bytes"] == r["active_experts"] * 3 * 32 * 16 * 4  # gate, up, down of each, fp32
    assert r["grouped_fraction_of_copy_rate"] > 0
