"""The grouped-GEMM MoE (stacked experts, one ``grouped_mm`` per projection) against the per-expert
reference path and against an independent per-token computation; per-expert checkpoint keys."""

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from test_device import HostSyncs
from torch.utils._python_dispatch import TorchDispatchMode

from dlm_toolkit.models import LLaDA2MoeModelLM, load_model, save_model
from dlm_toolkit.models import moe as moe_module
from dlm_toolkit.models.llada2 import Experts, combine_pairs, grouped_mm_supported
from dlm_toolkit.testing import tiny_llada2, tiny_llada2_config

FIXTURE = Path(__file__).resolve().parents[1] / "conformance/llada2_tiny"

# (hidden, expert width, experts, per token, groups, kept groups): group-limited routing in all but
# the first; odd and bf16-misaligned widths exercise the zero padding grouped_mm needs on the CPU.
SHAPES = [
    (32, 16, 8, 2, 1, 1),
    (32, 16, 16, 4, 4, 2),
    (33, 13, 12, 3, 3, 2),
    (36, 20, 16, 6, 8, 3),
]


def per_token_moe(experts: Experts, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Straight from the definition, in float64: y[n] = sum_k w[n,k] * down(silu(gate x) * up x)."""
    g, u, d = (getattr(experts, name).double() for name in ("gate_proj", "up_proj", "down_proj"))
    y = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[n, k])
            xn = x[n].double()
            y[n] += float(weight[n, k]) * (d[e] @ (F.silu(g[e] @ xn) * (u[e] @ xn)))
    return y


def random_moe(shape, seed: int, dtype=torch.float32):
    hidden, inner, n_exp, k, groups, kept = shape
    model = tiny_llada2(seed, hidden_size=hidden, moe_intermediate_size=inner, num_experts=n_exp,
                        num_experts_per_tok=k, n_group=groups, topk_group=kept, intermediate_size=24)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.expert_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    if dtype != torch.float32:  # built in dtype (the router stays float32), weights copied over
        model = _converted(model, dtype)
    return model, model.model.layers[1].mlp


def _converted(model: LLaDA2MoeModelLM, dtype: torch.dtype) -> LLaDA2MoeModelLM:
    out = LLaDA2MoeModelLM(model.config, dtype=dtype)
    out.load_state_dict(model.state_dict())
    return out.eval()


@pytest.mark.parametrize("shape", SHAPES)
@torch.no_grad()
def test_grouped_equals_reference_and_definition_fp32(shape):
    _, moe = random_moe(shape, seed=sum(shape))
    x = torch.randn(41, shape[0], generator=torch.Generator().manual_seed(1))
    _, idx, weight = moe.gate(x)
    exact = per_token_moe(moe.experts, x, idx, weight)
    grouped = moe.experts(x, idx, weight, "grouped")
    reference = moe.experts(x, idx, weight, "reference")
    scale = exact.abs().max()
    assert scale > 0
    assert (grouped.double() - exact).abs().max() < 1e-5 * scale
    assert (reference.double() - exact).abs().max() < 1e-5 * scale


@pytest.mark.parametrize("shape", SHAPES)
@torch.no_grad()
def test_grouped_bf16_within_bf16_tolerance(shape):
    _, moe = random_moe(shape, seed=sum(shape), dtype=torch.bfloat16)
    assert moe.experts.gate_proj.dtype == torch.bfloat16 and moe.gate.weight.dtype == torch.float32
    x = torch.randn(41, shape[0], generator=torch.Generator().manual_seed(1)).bfloat16()
    _, idx, weight = moe.gate(x)
    exact = per_token_moe(moe.experts, x, idx, weight)  # the same bf16 weights, exact arithmetic
    for impl in ("grouped", "reference"):
        y = moe.experts(x, idx, weight, impl)
        assert y.dtype == torch.bfloat16
        err = (y.double() - exact).abs()
        # a few bf16 roundings (inputs of down_proj, outputs, weighting): ~2^-8 relative each
        assert err.max() < 0.03 * exact.abs().max(), impl
        assert err.mean() < 0.01 * exact.abs().mean(), impl


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_whole_model_same_routing_and_logits(dtype):
    model, _ = random_moe((32, 16, 16, 4, 4, 2), seed=3, dtype=dtype)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(3, 12)
    mask = torch.ones(3, 12, 12, dtype=torch.bool)
    runs = {}
    for impl in ("grouped", "reference"):
        runs[impl] = model.set_moe_impl(impl).forward_window(ids, pos, mask, return_intermediates=True)
    (lg, tg), (lr, tr) = runs["grouped"], runs["reference"]
    for layer in range(1, model.config.num_hidden_layers):
        assert torch.equal(tg[f"router_topk_idx.{layer}"], tr[f"router_topk_idx.{layer}"])
    tol = 1e-5 if dtype == torch.float32 else 0.1
    assert (lg - lr).abs().max() < tol * lr.abs().max()


def test_grouped_path_is_two_grouped_gemms_without_host_sync(monkeypatch):
    """Gate and up stacked per expert: one grouped GEMM for both, one for down."""
    model, moe = random_moe((32, 16, 16, 4, 4, 2), seed=3)
    calls = []
    real = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    x = torch.randn(9, 32)
    _, idx, weight = moe.gate(x)
    with torch.no_grad(), HostSyncs() as syncs:
        moe.experts(x, idx, weight, "grouped")
    assert calls == [(16, 32, 32), (16, 16, 32)] and syncs.count == 0  # (E, H, 2I) then (E, I, H)
    with torch.no_grad(), HostSyncs() as syncs:
        moe.experts(x, idx, weight, "reference")
    assert len(calls) == 2 and syncs.count > 0  # the reference reads the counts on the host


def test_both_combine_orders_sum_each_tokens_pairs():
    N, K, H = 7, 3, 5
    out = torch.randn(N * K, H, dtype=torch.float64)
    order = torch.randperm(N * K, generator=torch.Generator().manual_seed(0))
    expected = torch.zeros(N, H, dtype=torch.float64)
    for row, pair in enumerate(order.tolist()):
        expected[pair // K] += out[row]
    for fixed in (True, False):
        assert torch.allclose(combine_pairs(out, order, K, fixed_order=fixed), expected)


def test_grouped_kernel_support_by_device():
    assert grouped_mm_supported(torch.device("cpu"), torch.float32)
    assert grouped_mm_supported(torch.device("cuda"), torch.bfloat16)
    assert not grouped_mm_supported(torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="moe_impl"):
        tiny_llada2(0).set_moe_impl("loop")


def test_a_torch_without_grouped_mm_runs_the_reference_path(monkeypatch):
    """GPU images can carry an older torch than our pin: the model must still run there."""
    model = tiny_llada2(0)
    ids = torch.randint(0, 50, (2, 12))
    want = model(ids)
    monkeypatch.delattr(torch.nn.functional, "grouped_mm")
    assert not grouped_mm_supported(torch.device("cpu"), torch.float32)
    torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-6)


def test_grouped_gradients_equal_reference():
    model, moe = random_moe((33, 13, 12, 3, 3, 2), seed=4)
    x = torch.randn(17, 33)
    _, idx, weight = moe.gate(x)
    target = torch.randn(17, 33)
    grads = {}
    for impl in ("grouped", "reference"):
        moe.zero_grad()
        ((moe.experts(x, idx, weight.detach(), impl) - target) ** 2).sum().backward()
        grads[impl] = [p.grad.clone() for p in moe.experts.parameters()]
    for g, r in zip(grads["grouped"], grads["reference"]):
        assert g.abs().max() > 0 and (g - r).abs().max() < 1e-5 * r.abs().max()


# -- checkpoint keys ------------------------------------------------------------------------


def test_state_dict_has_official_per_expert_keys_as_views():
    model = tiny_llada2(0)
    state = model.state_dict()
    experts = model.model.layers[1].mlp.experts
    assert not any(k.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) for k in state)
    for e in range(model.config.num_experts):
        for name in ("gate_proj", "up_proj", "down_proj"):
            view = state[f"model.layers.1.mlp.experts.{e}.{name}.weight"]
            assert view.data_ptr() == getattr(experts, name)[e].data_ptr()  # no copies
    assert state["model.layers.1.mlp.experts.2.down_proj.weight"].shape == (32, 16)


def test_fixture_round_trip_is_byte_identical(tmp_path):
    """Saving a loaded official-layout checkpoint writes the same keys, shapes and bytes, so what
    save_model writes loads wherever the official per-expert layout loads."""
    save_model(load_model(FIXTURE, mask_token_id=127, eos_token_id=126), tmp_path)
    with safe_open(FIXTURE / "model.safetensors", "pt") as a, safe_open(tmp_path / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
    assert json.loads((tmp_path / "config.json").read_text())["num_experts"] == 8


def test_load_state_dict_stacks_and_reports_missing_experts():
    source = tiny_llada2(1)
    model = LLaDA2MoeModelLM(tiny_llada2_config())
    model.load_state_dict(source.state_dict())
    assert torch.equal(model.model.layers[1].mlp.experts.up_proj[5], source.state_dict()["model.layers.1.mlp.experts.5.up_proj.weight"])
    partial = source.state_dict()
    del partial["model.layers.1.mlp.experts.3.gate_proj.weight"]
    with pytest.raises(RuntimeError, match="experts.gate_up_proj"):
        model.load_state_dict(partial)


def test_sharded_fixture_checkpoint_loads_bf16_and_saves_per_expert(tmp_path):
    model = load_model(FIXTURE, dtype=torch.bfloat16, mask_token_id=127, eos_token_id=126)
    assert model.model.layers[2].mlp.experts.gate_proj.shape == (8, 32, 64)
    save_model(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in index and len(set(index.values())) > 1
    again = load_model(tmp_path)
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("shape", SHAPES)
@torch.no_grad()
def test_dense_capture_path_equals_reference_and_definition(shape):
    """The path a capture takes where grouped GEMM does not run (float32 on CUDA): every expert on
    every token, weighted; against the float64 definition, and bit-close to the reference."""
    _, moe = random_moe(shape, seed=sum(shape))
    x = torch.randn(41, shape[0], generator=torch.Generator().manual_seed(1))
    _, idx, weight = moe.gate(x)
    exact = per_token_moe(moe.experts, x, idx, weight)
    dense = moe.experts._dense(x, idx, weight)
    assert (dense.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    torch.testing.assert_close(dense, moe.experts._reference(x, idx, weight), rtol=1e-6, atol=1e-7)


@torch.no_grad()
def test_dense_capture_path_leaves_out_other_ranks_experts():
    _, moe = random_moe(SHAPES[1], seed=3)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(2))
    _, idx, weight = moe.gate(x)
    half = Experts(8, 32, 16, torch.float32, first=8)  # experts 8..15 of 16, as rank 1 of 2
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(half, name).copy_(getattr(moe.experts, name)[8:])
    torch.testing.assert_close(half._dense(x, idx, weight), half._reference(x, idx, weight), rtol=1e-6, atol=1e-7)


def test_compiled_forward_without_grouped_kernel_takes_the_dense_path(monkeypatch):
    """Where grouped GEMM does not run, a captured forward must not fall back to the reference
    path's host reads: it compiles full-graph (no warning) and matches the eager reference."""
    import warnings

    from dlm_toolkit.step.capture import StepRunner
    from dlm_toolkit.models import moe as moe_module

    model = tiny_llada2(0)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    mask = torch.ones(2, 12, 12, dtype=torch.bool)
    monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda device, dtype: False)
    with torch.inference_mode():
        want = model.forward_window(ids, pos, mask)  # eager: the reference path
        runner = StepRunner(lambda i, p, m: model.forward_window(i, p, m), "no-grouped", "compile", backend="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = runner(ids, pos, mask)
    assert runner.compilations == 1 and not runner.failed
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- the host path (a CPU, eager, no grad, large windows) --------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 32, 544, 2048])
@torch.no_grad()
def test_host_path_equals_the_grouped_mm_path_bit_for_bit(dtype, tokens):
    """Whatever the chunking (every expert its own chunk, a few, one), the same bits as the
    grouped_mm path: each active expert's own GEMM, silu over one gate buffer, the sum's order."""
    gen = torch.Generator().manual_seed(tokens)
    for shape in (SHAPES[1], SHAPES[2]):  # aligned, and padded to the grouped GEMM's alignment
        _, moe = random_moe(shape, seed=tokens, dtype=dtype)
        x = torch.randn(tokens, shape[0], generator=gen).to(dtype)
        _, idx, weight = moe.gate(x)
        want = moe.experts._grouped(x, idx, weight, sharded=False)
        for rows in (1, 16, moe_module.HOST_CHUNK_ROWS):
            got = moe.experts._host_grouped(x, idx, weight, sharded=False, chunk_rows=rows)
            assert got.dtype == dtype and torch.equal(got, want), (shape, rows)


@pytest.mark.parametrize("first,count", [(0, 4), (4, 4), (3, 5)])
@torch.no_grad()
def test_host_path_under_expert_parallelism_equals_the_grouped_mm_path(first, count):
    """A rank's experts only; the other ranks' pairs are left out, not computed and zeroed."""
    _, moe = random_moe(SHAPES[2], seed=7)
    part = Experts(count, 33, 13, torch.float32, first=first)
    part.gate_up_proj.copy_(moe.experts.gate_up_proj[first:first + count])
    part.down_proj.copy_(moe.experts.down_proj[first:first + count])
    x = torch.randn(300, 33, generator=torch.Generator().manual_seed(first))
    _, idx, weight = moe.gate(x)
    want = part._grouped(x, idx, weight, sharded=True)
    assert want.abs().max() > 0 and ((idx < first) | (idx >= first + count)).any()  # others' pairs too
    for rows in (1, 64):
        assert torch.equal(part._host_grouped(x, idx, weight, sharded=True, chunk_rows=rows), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 32), (2, 544)])
def test_whole_model_logits_are_the_same_bits_on_the_host_path(monkeypatch, dtype, batch, tokens):
    model, _ = random_moe((32, 16, 16, 4, 4, 2), seed=5, dtype=dtype)
    ids = torch.randint(0, 64, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    pos = torch.arange(tokens).expand(batch, tokens)
    mask = torch.ones(batch, tokens, tokens, dtype=torch.bool)
    logits = {}
    for threshold in (0, 2**62):  # every window on the host path, none
        monkeypatch.setattr(moe_module, "HOST_MIN_ELEMENTS", threshold)
        with torch.inference_mode():
            logits[threshold] = model.forward_window(ids, pos, mask)
    assert torch.equal(logits[0], logits[2**62])


def test_host_path_runs_one_mm_per_active_expert_from_the_threshold_eager_without_grad(monkeypatch):
    """From HOST_MIN_ELEMENTS (pairs * hidden) on: one mm for gate and up and one for down per
    expert that received pairs, no grouped_mm; one element below, or with gradients: the
    grouped_mm path, which reads nothing on the host."""
    _, moe = random_moe((32, 16, 16, 4, 4, 2), seed=3)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))  # 20 pairs: some experts idle
    _, idx, weight = moe.gate(x)
    active = idx.unique().numel()
    assert active < 16
    grouped, real = [], F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **kw: grouped.append(1) or real(*a, **kw))

    def run(threshold: int, grad: bool = False):
        monkeypatch.setattr(moe_module, "HOST_MIN_ELEMENTS", threshold)
        grouped.clear()
        with torch.set_grad_enabled(grad), HostSyncs() as syncs, _Ops() as ops:
            moe.experts(x, idx, weight, "grouped")
        return len(grouped), ops.counts[torch.ops.aten.mm.out], syncs.count > 0

    assert run(20 * 32) == (0, 2 * active, True)  # the counts read on the host
    assert run(20 * 32 + 1) == (2, 0, False)
    assert run(0, grad=True) == (2, 0, False)  # the parameters require grad: mm(out=) has no backward


def test_compiled_forward_takes_the_grouped_mm_path_with_the_host_paths_bits(monkeypatch):
    """A compiled graph cannot hold the host path's read: with every eager window on the host
    path, the forward still compiles full-graph (no warning) and gives the eager bits."""
    import warnings

    from dlm_toolkit.step.capture import StepRunner

    monkeypatch.setattr(moe_module, "HOST_MIN_ELEMENTS", 0)
    model = tiny_llada2(0)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12).expand(2, 12)
    mask = torch.ones(2, 12, 12, dtype=torch.bool)
    with torch.inference_mode():
        want = model.forward_window(ids, pos, mask)
        runner = StepRunner(lambda i, p, m: model.forward_window(i, p, m), "host-moe", "compile", backend="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = runner(ids, pos, mask)
    assert runner.compilations == 1 and not runner.failed and torch.equal(got, want)


def test_chunks_close_at_the_row_count_and_leave_idle_experts_out():
    chunks = moe_module._chunks([3, 0, 2, 4, 0, 1, 5], rows=5)
    assert chunks == [(0, 5, [(0, 3), (2, 2)]), (5, 10, [(3, 4), (5, 1)]), (10, 15, [(6, 5)])]
    near = moe_module._chunks([3, 0, 2, 4, 0, 1, 5], rows=6)  # 3 + 2 = 5 < 6: the first chunk grows
    assert near == [(0, 9, [(0, 3), (2, 2), (3, 4)]), (9, 15, [(5, 1), (6, 5)])]
    assert moe_module._chunks([0, 0], rows=1) == [] and moe_module._chunks([2], rows=8) == [(0, 2, [(0, 2)])]


class _Ops(TorchDispatchMode):
    """Aten calls by overload while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))
