"""Who attends to whom, checked against a brute-force mask built from the schedules' definitions.

The definitions (``strategies/blocks_semi_ar.py``, ``strategies/blocks_multi_block_edit.py``):
a position's block is ``(p - origin) // B`` (positions before the origin, a prompt laid out with
``align: prompt``, form block -1); attention is block-causal: query p sees key q iff
``block(q) <= block(p)``. Multi-block editing with ``edit_blocks = k`` makes its window (the active
block b and up to k blocks before it, never before the first block holding a generated position)
one group: window positions count as block b, so earlier blocks of the window see the active one.

For every forward the engine runs, with the KV cache on and off, the set of keys each real query
sees (cached columns plus window columns) must equal the set the definition gives over
``[0, window end)``: nothing missing, nothing extra, nothing seen twice. A cached key must have
been written to the cache earlier, and what was written there must be the position's final token.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.testing import tiny_llada2


class Recorder:
    """Wraps a model; keeps every forward's inputs and the tokens each cache row received."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []
        self.cached: dict[int, dict[int, int]] = {}  # cache row -> {absolute position: token id}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward_window(self, ids, pos, attn_mask, cache=None, cache_rows=None, cache_write=None):
        S = attn_mask.shape[-1] - ids.shape[1]
        rows = cache_rows.tolist() if cache_rows is not None else [None] * ids.shape[0]
        before = {r: dict(self.cached.get(r, {})) for r in rows if r is not None}
        self.calls.append((ids.clone(), pos.clone(), attn_mask.clone(), S, rows, before))
        if cache_write is not None:
            for b, r in enumerate(rows):
                for t in cache_write[b].nonzero().flatten().tolist():
                    self.cached.setdefault(r, {})[int(pos[b, t])] = int(ids[b, t])
        return self.model.forward_window(ids, pos, attn_mask, cache=cache, cache_rows=cache_rows, cache_write=cache_write)


def expected_keys(p: int, hi: int, prompt_len: int, origin: int, B: int, k: int | None) -> set[int]:
    def block(q: int) -> int:
        return -1 if q < origin else (q - origin) // B

    active = block(hi - 1)
    if k is None:
        window_start = hi  # semi_ar: no window group beyond the active block's own
    else:
        first_gen = origin + ((prompt_len - origin) // B) * B
        window_start = max(origin + (active - k) * B, first_gen)

    def group(q: int) -> int:
        return active if q >= window_start else block(q)

    return {q for q in range(hi) if group(q) <= group(p)}


def real_queries(ids, attn, S: int) -> list[int]:
    """Window columns of the real queries: the engine's forwards have fixed shapes, so a forward
    also holds padding queries, which see only their own column (and nothing else)."""
    T = ids.shape[1]
    own = attn[0, :, S:].diagonal()
    alone = (attn[0].sum(-1) == 1) & own
    return [t for t in range(T) if not alone[t]]


def check(rec: Recorder, prompt_len: int, origin: int, B: int, k: int | None, final: list[int], mask_id: int) -> int:
    checked = 0
    calls = [(c, real_queries(c[0], c[2], c[3])) for c in rec.calls]
    for i, ((ids, pos, attn, S, rows, cached_before), real) in enumerate(calls):
        assert ids.shape[0] == 1
        # the window ends at the last real query; a prefill (the first forward holding no mask with
        # the cache on) fills the cache for the window of the step that follows it
        prefill = i == 0 and S > 0 and all(int(ids[0, t]) != mask_id for t in real)
        window_pos, window_real = (calls[1][0][1], calls[1][1]) if prefill else (pos, real)
        hi = max(int(window_pos[0, t]) for t in window_real) + 1
        in_cache = cached_before.get(rows[0], {}) if rows[0] is not None else {}
        for t in real:
            p = int(pos[0, t])
            seen = [c for c in range(S) if attn[0, t, c]] + [int(pos[0, u]) for u in real if attn[0, t, S + u]]
            assert not any(attn[0, t, S + u] for u in range(ids.shape[1]) if u not in real and u != t), \
                f"query {p} sees a padding key"
            assert len(seen) == len(set(seen)), f"query {p} sees a key twice: {sorted(seen)}"
            assert set(seen) == expected_keys(p, hi, prompt_len, origin, B, k), (p, hi, sorted(seen))
            for c in range(S):
                if attn[0, t, c]:
                    assert c in in_cache, f"query {p} sees cache position {c}, which was never written"
            checked += 1
    for row_cache in rec.cached.values():
        for q, tok in row_cache.items():
            assert final[q] == tok, f"position {q} entered the cache as {tok} but ended as {final[q]}"
    return checked


SCHEDULES = [("semi_ar", None), ("multi_block_edit", 0), ("multi_block_edit", 1), ("multi_block_edit", 2)]


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "no-kv"])
@pytest.mark.parametrize("name,k", SCHEDULES, ids=[f"{n}-{k}" for n, k in SCHEDULES])
@pytest.mark.parametrize("align", ["absolute", "prompt"])
def test_attention_matches_the_schedule_definition(name: str, k: int | None, kv: bool, align: str):
    model = tiny_llada2(4)
    B = 4
    total = 0
    for seed in range(3):
        rng = random.Random(seed)
        prompt = [rng.randrange(0, 60) for _ in range(rng.randint(2, 9))]
        params: dict[str, Any] = {"block_length": B, "max_post_steps": 3, "eos_early_stop": False, "align": align}
        if k is not None:
            params["edit_blocks"] = k
        policy = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.6}},
                                 "t2t": {"name": "threshold", "params": {"threshold": 0.3}},
                                 "blocks": {"name": name, "params": params}})
        rec = Recorder(model)
        res = decode(rec, [prompt], policy, 14, kv_cache=kv)
        origin = len(prompt) if align == "prompt" else 0
        total += check(rec, len(prompt), origin, B, k, res.canvas[0].tolist(), model.mask_token_id)
    assert total > 0
