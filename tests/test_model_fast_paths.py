"""The LLaDA2 forward's fast forms against their op-by-op forms, bit for bit: RoPE as one copy and
three elementwise ops over whole heads (:class:`Rope`), the q/k head norms as one norm
(``Attention.qk_norm``), the additive float mask built once per forward, the KV cache with K and V
in one tensor (read by one ``index_select``, written by one ``index_put_``), the padding queries
zeroed in place, and the router's group step (skipped when every group is kept)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dlm_toolkit.models.llada2 import (
    Attention, Experts, KVCache, LLaDA2MoeModelLM, MoE, Rope, Router, apply_partial_rope, rope_cos_sin,
)
from dlm_toolkit.testing import tiny_llada2_config

DTYPES = [torch.float32, torch.bfloat16]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [8, 16])  # head_dim 16: partial (R = D/2) and whole-head RoPE
def test_rope_equals_the_rotate_half_reference(dtype, rot_dim):
    D, theta = 16, 600000.0
    pos = torch.randint(0, 5000, (3, 7), generator=gen(0))
    x = (torch.randn(3, 5, 7, D, generator=gen(1)) * 3).to(dtype)
    got = Rope.build(pos, rot_dim, D, theta, dtype).apply(x)
    assert torch.equal(got, apply_partial_rope(x, *rope_cos_sin(pos, rot_dim, theta, dtype)))
    # an independent float64 rotation: pair (i, i + R/2) turned by pos * theta^(-2i/R); the rest as is
    x64, want = x.double(), x.double().clone()
    half = rot_dim // 2
    for i in range(half):
        angle = pos.double()[:, None] * theta ** (-2 * i / rot_dim)
        a, b = x64[..., i], x64[..., i + half]
        want[..., i], want[..., i + half] = a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()
    tol = 2e-3 if dtype == torch.float32 else 8e-2  # float32 angles of positions up to 5000: ~3e-4 rad
    assert (got.double() - want).abs().max() < tol
    assert torch.equal(got[..., rot_dim:], x[..., rot_dim:])  # pass-through dims untouched, bit for bit


def test_rope_swap_is_the_rotate_half_partner():
    """swap: [R/2 .. R-1, 0 .. R/2-1, R .. D-1] (a ``cat`` of slices, or a ``roll`` when R = D)."""
    x = torch.arange(16.0).expand(2, 3, 16)
    cos = torch.ones(1, 1, 1, 16)
    assert Rope(cos, cos, 8).swap(x)[0, 0].tolist() == [4, 5, 6, 7, 0, 1, 2, 3, *range(8, 16)]
    assert Rope(cos, cos, 16).swap(x)[0, 0].tolist() == [*range(8, 16), *range(8)]
    assert Rope(cos, cos, 4).swap(x)[0, 0].tolist() == [2, 3, 0, 1, *range(4, 16)]


def test_rope_near_miss_halves_not_swapped_differs():
    pos = torch.arange(1, 6)[None]
    rope = Rope.build(pos, 8, 16, 10000.0, torch.float32)
    x = torch.randn(1, 2, 5, 16, generator=gen(2))
    for wrong in (Rope(rope.cos, rope.sin, 0), Rope(rope.cos, rope.sin, 16)):  # nothing swapped; the whole head
        assert not torch.equal(wrong.apply(x), rope.apply(x))


def attention(cfg, dtype: torch.dtype, seed: int) -> Attention:
    attn = Attention(cfg, dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen(seed)) * 0.5)
            seed += 1
    return attn


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_equals_the_two_head_norms(dtype):
    attn = attention(tiny_llada2_config(), dtype, 3)
    qk = (torch.randn(2, attn.nq + attn.nkv, 5, attn.hd, generator=gen(4)) * 4).to(dtype)
    want = torch.cat([attn.query_layernorm(qk[:, :attn.nq]), attn.key_layernorm(qk[:, attn.nq:])], 1)
    assert torch.equal(attn.qk_norm(qk), want)
    with torch.no_grad():  # near miss: the key norm's own weight matters
        attn.key_layernorm.weight.add_(1)
    assert not torch.equal(attn.qk_norm(qk), want)


def reference_attention(attn: Attention, rot_dim: int, x, pos, mask, cache_kv=None, rows=None, write_pos=None):
    """The op-by-op attention: two head norms, rotate-half RoPE, keys gathered by advanced
    indexing from separate K and V caches, SDPA on the bool mask, padding queries zeroed, then the
    cache write, K and V apart."""
    B, T, _ = x.shape
    qkv = attn.query_key_value(x).view(B, T, attn.nq + 2 * attn.nkv, attn.hd).transpose(1, 2)
    q, k, v = qkv.split([attn.nq, attn.nkv, attn.nkv], dim=1)
    cos, sin = rope_cos_sin(pos, rot_dim, 10000.0, x.dtype)
    q = apply_partial_rope(attn.query_layernorm(q), cos, sin)
    k = apply_partial_rope(attn.key_layernorm(k), cos, sin)
    S = mask.shape[-1] - T
    if S:
        k_all = torch.cat([cache_kv[0][rows, :, :S], k], 2)
        v_all = torch.cat([cache_kv[1][rows, :, :S], v], 2)
    else:
        k_all, v_all = k, v
    out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
    out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    if write_pos is not None:
        r = rows[:, None].expand(B, T)
        cache_kv[0][r, :, write_pos] = k.transpose(1, 2)
        cache_kv[1][r, :, write_pos] = v.transpose(1, 2)
    return attn.dense(out.transpose(1, 2).reshape(B, T, -1))


CASES = {  # name: (cache prefix S, cache rows of the batch or None, write some entries)
    "uncached": (0, None, False),
    "prefill": (0, [2, 0, 3], True),  # no prefix read, the window written
    "cached": (6, [2, 0, 3], True),  # rows in another order than the batch, one unused
    "cached-identity": (6, [0, 1, 2], True),
    "cached-read-only": (9, [3, 1, 0], False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_attention_equals_the_reference(dtype, float_mask, case):
    """Rows of different prompt lengths (prefix columns masked per row), a row with a padding query
    (sees nothing), a partial cache write: output and cache equal the op-by-op path with separate
    K and V caches bit for bit, and the cache's ``k``/``v`` are views of its halves."""
    S, rows, write_some = CASES[case]
    cfg = tiny_llada2_config()
    attn = attention(cfg, dtype, 10)
    B, T, L = 3, 4, 12
    x = torch.randn(B, T, cfg.hidden_size, generator=gen(5)).to(dtype)
    pos = S + torch.arange(T).expand(B, T)
    mask = torch.rand(B, 1, T, S + T, generator=gen(6)) > 0.3
    mask[..., S:] |= torch.eye(T, dtype=torch.bool)  # every query sees itself ...
    mask[1, ..., S - 2:S] = False  # (a shorter prompt in row 1)
    mask[2, 0, 1] = False  # ... but this padding query, which sees nothing
    rows = None if rows is None else torch.tensor(rows)
    write_pos = torch.where(torch.rand(B, T, generator=gen(7)) > 0.5, pos, L) if write_some else None
    shape = (4, 2 * attn.nkv, L + 1, attn.hd)  # cache rows, K heads then V heads, positions + the spare
    cache = None if rows is None else KVCache([torch.randn(shape, generator=gen(8)).to(dtype)])
    apart = None if cache is None else (cache.k[0].clone(), cache.v[0].clone())
    rope = Rope.build(pos, cfg.rotary_dim, cfg.head_dim, 10000.0, dtype)
    arg = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")) if float_mask else mask
    got = attn(x, rope, arg, None if cache is None else cache.kv[0], rows, write_pos)
    want = reference_attention(attn, cfg.rotary_dim, x, pos, mask, apart, rows, write_pos)
    assert torch.equal(got, want)
    assert torch.equal(got[2, 1], torch.zeros_like(got[2, 1]))  # zeroed, not NaN
    if cache is not None:
        assert torch.equal(cache.k[0], apart[0]) and torch.equal(cache.v[0], apart[1])
        assert cache.k[0].data_ptr() == cache.kv[0].data_ptr()  # views, not copies
    if S:  # near miss: the rows' order matters (another row's cached keys give other values)
        moved = attn(x, rope, arg, cache.kv[0].clone(), rows.flip(0), write_pos)
        assert not torch.equal(moved, got)


def test_attention_under_autograd_keeps_sdpa_output_and_equals_inference():
    """The padding queries are zeroed in place only when autograd does not keep SDPA's output for
    the backward (doing it anyway fails the backward); the values are the same either way."""
    cfg = tiny_llada2_config()
    attn = attention(cfg, torch.float32, 10)
    B, T = 2, 5
    x = torch.randn(B, T, cfg.hidden_size, generator=gen(5))
    pos = torch.arange(T).expand(B, T)
    mask = torch.ones(B, 1, T, T, dtype=torch.bool)
    mask[1, 0, 4] = False  # a padding query
    rope = Rope.build(pos, cfg.rotary_dim, cfg.head_dim, 10000.0, torch.float32)
    out = attn(x, rope, mask)
    out.sum().backward()
    assert attn.dense.weight.grad is not None and torch.isfinite(attn.query_key_value.weight.grad).all()
    with torch.inference_mode():
        assert torch.equal(attn(x, rope, mask), out.detach())


def reference_forward(model: LLaDA2MoeModelLM, ids, pos, mask, apart=None, rows=None, write_pos=None):
    """The whole forward op by op: :func:`reference_attention` on the bool mask (B, T, S+T), with
    separate K and V caches per layer (``apart``: two lists), the layers' own norms and MLP/MoE."""
    h = model.model.word_embeddings(ids)
    for i, layer in enumerate(model.model.layers):
        cache = None if apart is None else (apart[0][i], apart[1][i])
        h = h + reference_attention(layer.attention, model.config.rotary_dim, layer.input_layernorm(h), pos,
                                    mask[:, None], cache, rows, write_pos)
        x = layer.post_attention_layernorm(h)
        h = h + (layer.mlp(x, None, i) if isinstance(layer.mlp, MoE) else layer.mlp(x))
    return model.lm_head(model.model.norm(h)).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [0.5, 1.0])  # partial and whole-head RoPE
@torch.no_grad()
def test_forward_window_equals_the_op_by_op_forward(dtype, rotary):
    """``forward_window`` (tables, mask and padding queries once per forward, K and V in one cache
    tensor) against :func:`reference_forward`, bit for bit: uncached, then a prefill of rows of
    different prompt lengths into cache rows in another order, a window with a partial write, a
    read-only window; logits of every forward and both caches at the end."""
    cfg = tiny_llada2_config(partial_rotary_factor=rotary)
    model = LLaDA2MoeModelLM(cfg).init_weights(3)
    if dtype != torch.float32:
        state = model.state_dict()
        model = LLaDA2MoeModelLM(cfg, dtype=dtype)
        model.load_state_dict(state)
    for name, b in model.named_buffers():  # a random expert bias, so that it changes the routing
        b.copy_(torch.randn(b.shape, generator=gen(30)) * 0.1)
    B, P, T, L = 3, 10, 4, 20
    rows, plen = torch.tensor([2, 0, 3]), torch.tensor([10, 6, 8])
    ids = torch.randint(0, 60, (B, P + 2 * T), generator=gen(31))
    valid = torch.arange(P)[None] < plen[:, None]  # prompts of different lengths, padded at the end
    pre_mask = (valid[:, None, :] & valid[:, :, None]) | torch.eye(P, dtype=torch.bool)
    pos = torch.arange(P).expand(B, P)
    uncached = model.forward_window(ids[:, :P], pos, pre_mask)
    assert torch.equal(uncached, reference_forward(model, ids[:, :P], pos, pre_mask))
    cache = model.new_cache(4, L)
    apart = ([k.clone() for k in cache.k], [v.clone() for v in cache.v])
    steps = [(ids[:, :P], pos, pre_mask, torch.where(valid, pos, L))]  # the prefill writes the prompts
    for j, write in ((0, torch.rand(B, T, generator=gen(32)) > 0.5), (1, None)):
        win = plen[:, None] + j * T + torch.arange(T)  # each row's window right after its own prefix
        seen = torch.arange(P)[None, None, :] < (plen[:, None, None] + j * T)
        mask = torch.cat([seen.expand(B, T, P), torch.ones(B, T, T, dtype=torch.bool)], -1)
        mask[1, 2] = False  # a padding query: sees nothing
        write_pos = None if write is None else torch.where(write, win, L)
        steps.append((ids[:, P + j * T:P + (j + 1) * T], win, mask, write_pos))
    for step_ids, step_pos, mask, write_pos in steps:
        write = None if write_pos is None else write_pos < L
        got = model.forward_window(step_ids, step_pos, mask, cache=cache, cache_rows=rows, cache_write=write)
        want = reference_forward(model, step_ids, step_pos, mask, apart, rows, write_pos)
        assert torch.equal(got, want)
        assert torch.isfinite(got).all()
    assert all(torch.equal(a, b) for a, b in zip(cache.k + cache.v, apart[0] + apart[1]))
    assert cache.k[0][1].abs().sum() == 0 and cache.k[0][2, :, :P].abs().sum() > 0  # row 1 unused, row 2 written


def reference_router(router: Router, x: torch.Tensor, G: int, kg: int, K: int, scale: float):
    """DESIGN.md's routing, token by token in float64: group score = sum of its top-2 biased
    scores, keep the top ``kg`` groups, top ``K`` experts among them, unbiased scores normalised."""
    scores = torch.sigmoid(x.double() @ router.weight.double().T)
    biased = scores + router.expert_bias.double()
    E = scores.shape[1]
    idx, weight = [], []
    for n in range(x.shape[0]):
        groups = sorted(range(G), key=lambda g: -sum(sorted(biased[n, g * E // G:(g + 1) * E // G].tolist())[-2:]))[:kg]
        allowed = [e for e in range(E) if e // (E // G) in groups]
        chosen = sorted(allowed, key=lambda e: -biased[n, e].item())[:K]
        w = scores[n, chosen]
        idx.append(chosen)
        weight.append((w / w.sum() * scale).tolist())
    return idx, weight


@pytest.mark.parametrize("topk_group", [1, 2, 3, 4])  # 4 of 4: every group kept, the group step is skipped
def test_router_equals_the_design_formula(topk_group):
    cfg = tiny_llada2_config(num_experts=16, num_experts_per_tok=3, n_group=4, topk_group=topk_group)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen(11)))
        router.expert_bias.copy_(torch.randn(16, generator=gen(12)) * 0.3)
    x = torch.randn(40, cfg.hidden_size, generator=gen(13))
    _, idx, weight = router(x)
    want_idx, want_weight = reference_router(router, x, 4, topk_group, 3, cfg.routed_scaling_factor)
    assert idx.tolist() == want_idx
    assert torch.allclose(weight.double(), torch.tensor(want_weight, dtype=torch.float64), atol=1e-6)


def test_router_group_limit_binds():
    """Near miss for the skip: with fewer groups kept than exist, some token's plain top-k differs."""
    cfg = tiny_llada2_config(num_experts=16, num_experts_per_tok=3, n_group=4, topk_group=1)
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen(11)))
    x = torch.randn(40, cfg.hidden_size, generator=gen(13))
    logits, idx, _ = router(x)
    assert not torch.equal(idx, logits.sigmoid().topk(3, dim=-1).indices)


@pytest.mark.parametrize("hidden,inner", [(32, 16), (256, 128), (36, 10)])  # 36/10: padded to the alignment
@pytest.mark.parametrize("tokens", [1, 7, 64])
@torch.no_grad()
def test_grouped_experts_with_gate_and_up_stacked_equal_two_grouped_gemms(hidden, inner, tokens):
    """One grouped GEMM over the stacked gate/up rows gives the bits of a grouped GEMM each (silu
    on a contiguous copy of the gate columns: on a strided view it rounds differently)."""
    from dlm_toolkit.models.moe import _aligned, combine_pairs

    experts = Experts(8, hidden, inner, torch.float32)
    x = torch.randn(tokens, hidden, generator=gen(20))
    idx = torch.randint(0, 8, (tokens, 3), generator=gen(21))
    weight = torch.rand(tokens, 3, generator=gen(22))
    order = idx.flatten().argsort(stable=True)
    offs = torch.searchsorted(idx.flatten()[order], torch.arange(1, 9), out_int32=True)
    xs = _aligned(x[order // 3], 4)
    gate, up = (F.grouped_mm(xs, _aligned(w, 4, 2).transpose(-2, -1), offs=offs)
                for w in (experts.gate_proj.contiguous(), experts.up_proj.contiguous()))
    out = F.grouped_mm(F.silu(gate) * up, _aligned(experts.down_proj, 4, 2).transpose(-2, -1), offs=offs)[:, :hidden]
    want = combine_pairs(out * weight.flatten()[order, None], order, 3, fixed_order=False)
    assert torch.equal(experts(x, idx, weight, "grouped"), want)
