"""The native LLaDA2 MoE model against the conformance fixture (conformance/llada2_tiny)."""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from dlm_toolkit.models import DiffusionLM, KVCache, LLaDA2Config, LLaDA2MoeModelLM, load_model

FIXTURE = Path(__file__).resolve().parents[1] / "conformance/llada2_tiny"
BLOCK = 8
TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> LLaDA2MoeModelLM:
    return load_model(FIXTURE, mask_token_id=127, eos_token_id=126)


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE / "logits.safetensors")


def block_causal(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(B, T) query positions, (B, S) key positions -> (B, T, S) bool: j // B <= i // B."""
    return (k_pos[:, None, :] // BLOCK) <= (q_pos[:, :, None] // BLOCK)


def tiny_config(**overrides) -> LLaDA2Config:
    fields = dict(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=64,
    )
    return LLaDA2Config(**(fields | overrides))


def test_fixture_mask_is_block_causal(ref):
    pos = ref["position_ids"]
    assert torch.equal(block_causal(pos, pos)[0], ref["attention_allowed_block_causal"].bool())


@torch.no_grad()
def test_logits_match_reference(model, ref):
    ids, pos = ref["input_ids"], ref["position_ids"]
    bc = model.forward_window(ids, pos, block_causal(pos, pos))
    assert bc.dtype == torch.float32 and bc.shape == (2, 24, 128)
    assert (bc - ref["logits_block_causal"]).abs().max() < TOL
    bidir = model(ids)
    assert (bidir - ref["logits_bidirectional"]).abs().max() < TOL
    assert (bc - bidir).abs().max() > 0.1  # the mask matters


@torch.no_grad()
def test_intermediates_and_routing_match_reference(model, ref):
    ids, pos = ref["input_ids"], ref["position_ids"]
    _, trace = model.forward_window(ids, pos, block_causal(pos, pos), return_intermediates=True)
    names = [k.removeprefix("block_causal.") for k in ref if k.startswith("block_causal.")]
    assert sorted(names) == sorted(trace)
    for name in names:
        expected = ref[f"block_causal.{name}"]
        if "topk_idx" in name:
            assert torch.equal(trace[name], expected), name
        else:
            assert (trace[name] - expected).abs().max() < TOL, name


@torch.no_grad()
def test_kv_cache_block_by_block_equals_uncached(model, ref):
    ids, pos = ref["input_ids"], ref["position_ids"]
    cache = model.new_cache(batch_size=2, max_length=32)
    assert isinstance(cache, KVCache) and cache.k[0].shape == (2, 2, 33, 16) and cache.max_length == 32
    rows = torch.arange(2)
    for b in range(3):
        lo, hi = b * BLOCK, (b + 1) * BLOCK
        win_pos = pos[:, lo:hi]
        mask = block_causal(win_pos, pos[:, :hi])  # keys: cache 0..lo-1, then the window
        logits = model.forward_window(ids[:, lo:hi], win_pos, mask, cache=cache, cache_rows=rows,
                                      cache_write=torch.ones(2, BLOCK, dtype=torch.bool))
        assert (logits - ref["logits_block_causal"][:, lo:hi]).abs().max() < TOL, b


@torch.no_grad()
def test_kv_cache_prefix_in_one_forward_and_partial_writes(model, ref):
    ids, pos = ref["input_ids"], ref["position_ids"]
    cache = model.new_cache(2, 24)
    rows = torch.arange(2)
    write = torch.zeros(2, 24, dtype=torch.bool)
    write[:, :16] = True  # only the two finished blocks go to the cache
    model.forward_window(ids, pos, block_causal(pos, pos), cache=cache, cache_rows=rows, cache_write=write)
    assert cache.k[0][:, :, 16:24].abs().sum() == 0  # the spare slot 24 takes the rest
    window = pos[:, 16:]
    logits = model.forward_window(ids[:, 16:], window, block_causal(window, pos), cache=cache, cache_rows=rows)
    assert (logits - ref["logits_block_causal"][:, 16:]).abs().max() < TOL


@torch.no_grad()
def test_rows_use_their_own_cache_rows(model, ref):
    ids, pos = ref["input_ids"], ref["position_ids"]
    cache = model.new_cache(3, 24)
    # sequence 0's prefix into cache row 2, sequence 1's into row 0 (row 1 stays empty)
    model.forward_window(ids[:, :16], pos[:, :16], block_causal(pos[:, :16], pos[:, :16]), cache=cache,
                         cache_rows=torch.tensor([2, 0]), cache_write=torch.ones(2, 16, dtype=torch.bool))
    assert cache.v[1][1].abs().sum() == 0
    logits = model.forward_window(ids[:, 16:], pos[:, 16:], block_causal(pos[:, 16:], pos), cache=cache,
                                  cache_rows=torch.tensor([2, 0]))
    assert (logits - ref["logits_block_causal"][:, 16:]).abs().max() < TOL
    # one row alone, from its cache row, gives the same logits as in the batch
    alone = model.forward_window(ids[1:, 16:], pos[1:, 16:], block_causal(pos[1:, 16:], pos[1:]), cache=cache,
                                 cache_rows=torch.tensor([0]))
    assert (alone - logits[1:]).abs().max() < TOL


@torch.no_grad()
def test_fully_masked_padding_row_does_not_poison(model, ref):
    ids, pos = ref["input_ids"], ref["position_ids"]
    mask = block_causal(pos, pos)
    mask[:, :, 20:] = False  # positions 20.. are "padding": nobody attends to them
    mask[:, 20:, :] = False  # and they attend to nothing
    logits = model.forward_window(ids, pos, mask)
    assert torch.isfinite(logits).all()
    clean = model.forward_window(ids[:, :20], pos[:, :20], mask[:, :20, :20])
    assert (logits[:, :20] - clean).abs().max() < TOL


@torch.no_grad()
def test_bfloat16_close_to_float32(ref):
    model16 = load_model(FIXTURE, dtype=torch.bfloat16, mask_token_id=127, eos_token_id=126)
    assert model16.lm_head.weight.dtype == torch.bfloat16
    assert model16.model.layers[1].mlp.gate.weight.dtype == torch.float32  # router stays fp32
    ids, pos = ref["input_ids"], ref["position_ids"]
    logits = model16.forward_window(ids, pos, block_causal(pos, pos))
    assert logits.dtype == torch.float32
    expected = ref["logits_block_causal"]
    # Logits span about +-21. bf16 rounding flips the routing of a few tokens (then those and the
    # tokens attending to them move by several units), so bound the typical error, not the worst.
    assert (logits - expected).abs().amax(-1).median() < 0.5
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean()
    assert agree > 0.9


def test_router_groups_and_weights():
    cfg = tiny_config(routed_scaling_factor=2.0)
    model = LLaDA2MoeModelLM(cfg).init_weights(seed=0)
    router = model.model.layers[1].mlp.gate
    x = torch.randn(50, 32)
    _, idx, weight = router(x)
    groups = idx // (cfg.num_experts // cfg.n_group)
    assert all(len(set(g.tolist())) <= cfg.topk_group for g in groups)
    assert torch.allclose(weight.sum(-1), torch.full((50,), 2.0))


@torch.no_grad()
def test_random_init_gives_finite_logits():
    model = LLaDA2MoeModelLM(tiny_config(), mask_token_id=31, eos_token_id=30).init_weights(seed=0)
    assert isinstance(model, DiffusionLM)
    assert model.attention == "block_causal" and model.supports_kv_cache and model.vocab_size == 32
    ids = torch.randint(0, 32, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 32) and torch.isfinite(logits).all() and logits.abs().max() > 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 0.375}, "partial_rotary_factor"),  # 8 * 0.375 = 3, odd
        ({"hidden_size": 0}, "hidden_size"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"mask_token_id": 32}, "mask_token_id"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValidationError, match=field):
        tiny_config(**overrides)


def test_config_keeps_unknown_keys():
    cfg = tiny_config(torch_dtype="float32", rope_scaling=None)
    d = cfg.to_hf_dict()
    assert d["torch_dtype"] == "float32" and "rope_scaling" in d and "mask_token_id" not in d


def test_forward_window_rejects_bad_shapes(model):
    ids = torch.zeros(1, 4, dtype=torch.long)
    pos = torch.arange(4)[None]
    with pytest.raises(ValueError, match="attn_mask"):
        model.forward_window(ids, pos, torch.ones(1, 4, 4))  # not bool
    with pytest.raises(ValueError, match="cache"):
        model.forward_window(ids, pos, torch.ones(1, 4, 6, dtype=torch.bool))  # S=2 without a cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_matches_the_formula_in_float64(dtype):
    from dlm_toolkit.models.llada2 import RMSNorm

    norm = RMSNorm(64, 1e-6, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(1)))
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)) * 7).to(dtype)
    x64, w64 = x.double(), norm.weight.double()
    want = w64 * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = norm(x)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the float32 result
    assert ((got.double() - want).abs() / want.abs().clamp_min(1)).max() < tol
    assert torch.equal(got, norm.reference(x)) or (got.float() - norm.reference(x).float()).abs().max() < tol * 8
