"""Every counter of a decode pinned exactly on a hand-worked scripted decode, with the KV cache on and
off (issue 36): the values below are worked out by hand from the table, step by step, not read from
the engine. Compiled = eager and batch = alone run the same counting code, so they cannot catch a
counter that counts the wrong thing; this can."""

from __future__ import annotations

import pytest
import torch

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.step.state import COUNTERS
from dlm_toolkit.testing import ScriptedLM

V, MASK, EOS = 8, 7, 6
A, B, C, D, E = 1, 2, 3, 4, 5
BL = 4
m = MASK

# (block index, the block's content in the forward) -> (argmax token, its probability) per position.
# Policy: commit p > 0.7 (else the top-1 mask), edit p > 0.5 where the argmax differs, blocks of 4,
# post steps allowed. Prompt [0, 1, 2, 3] fills block 0; blocks 1 (positions 4..7) and 2 (8..11).
TABLE = {
    # step 1: commits 4, 5 (two commits: a multi-commit step; the first step of block 1)
    (1, (m, m, m, m)): [(A, .9), (A, .9), (C, .4), (D, .4)],
    # step 2: commits 6; edits 4 (A -> B, .6 > .5)
    (1, (A, A, m, m)): [(B, .6), (A, .9), (C, .9), (D, .4)],
    # step 3: nothing above .7: the top-1 fallback commits 7
    (1, (B, A, C, m)): [(B, .9), (A, .9), (C, .9), (D, .4)],
    # step 4: a post forward without an edit: block 1 ends
    (1, (B, A, C, D)): [(B, .9), (A, .9), (C, .9), (D, .9)],
    # step 5: four commits (a multi-commit step; the first step of block 2)
    (2, (m, m, m, m)): [(A, .9), (B, .9), (C, .9), (D, .9)],
    # step 6: a post forward with an edit (9: B -> E)
    (2, (A, B, C, D)): [(A, .9), (E, .6), (C, .9), (D, .9)],
    # step 7: a post forward without an edit: block 2, the last, ends
    (2, (A, E, C, D)): [(A, .9), (E, .9), (C, .9), (D, .9)],
}


def row_logits(token: int, p: float) -> torch.Tensor:
    row = torch.full((V,), (1 - p) / (V - 2)).log()
    row[token], row[MASK] = torch.tensor(p).log(), -torch.inf
    return row


class _TableLM(ScriptedLM):
    """Logits looked up by each whole generated block's content (the prompt's block and partial blocks
    get flat logits); with ``cached`` it accepts the engine's KV-cache arguments (the logits depend on
    no cached key, so the cache changes no logit)."""

    def __init__(self, cached: bool):
        super().__init__(self.lookup, V, MASK, EOS)
        self.supports_kv_cache = cached
        self.seen: list[tuple] = []

    def new_cache(self, batch_size: int, max_length: int):
        return {"rows": batch_size, "length": max_length}  # never read: the table needs no keys

    def lookup(self, ids, pos, attn):
        out = torch.zeros(*ids.shape, V)
        out[..., MASK] = -torch.inf
        for b in range(ids.shape[0]):
            p = pos[b].tolist()
            for k in (1, 2):
                where = [i for i, q in enumerate(p) if q // BL == k]
                if len(where) != BL:
                    continue
                content = tuple(int(ids[b, i]) for i in sorted(where, key=lambda i: p[i]))
                assert (k, content) in TABLE, f"block {k} holds {content}: the decode left the hand-worked path"
                self.seen.append((k, content))
                for i, (tok, prob) in zip(sorted(where, key=lambda i: p[i]), TABLE[(k, content)]):
                    out[b, i] = row_logits(tok, prob)
        return out


POLICY = {"m2t": {"name": "threshold", "params": {"threshold": 0.7}},
          "t2t": {"name": "threshold", "params": {"threshold": 0.5}},
          "blocks": {"name": "semi_ar", "params": {"block_length": BL, "max_post_steps": 16, "eos_early_stop": False}}}

# hand-counted from TABLE (comments above): 7 forwards, commits 2+1+1+4, edits at steps 2 and 6,
# multi-commit steps 1 (exactly two commits) and 5, post forwards 4, 6, 7 (6 with an edit), two blocks
EXPECTED = {"nfe": 7, "commits": 8, "edits": 2, "remasks": 0, "multi_commit_steps": 2, "post_forwards": 3,
            "post_forwards_with_edit": 1, "blocks_decoded": 2, "inserts": 0, "deletes": 0}
# forward_tokens, cache on: the prefill of block 0 (4), block 1's four forwards of its 4 positions (16),
# block 2's first forward over blocks 1 and 2 (8: block 1 enters the cache) then two of 4 (8): 36.
# Cache off: every forward spans the canvas up to the block's end: 4 x 8 + 3 x 12 = 68.
FORWARD_TOKENS = {True: 4 + 4 * 4 + 8 + 2 * 4, False: 4 * 8 + 3 * 12}
# forward_calls: the NFE, plus the prefill forward when the cache is on (the prompt fills block 0)
FORWARD_CALLS = {True: 7 + 1, False: 7}


@pytest.mark.parametrize("cached", [True, False], ids=["kv", "no-kv"])
def test_every_counter_equals_the_hand_count(cached):
    model = _TableLM(cached)
    res = decode(model, [[0, 1, 2, 3]], DecodingPolicy(POLICY), 8, kv_cache=cached)
    assert res.tokens == [[B, A, C, D, A, E, C, D]]
    assert [s for s in dict.fromkeys(model.seen)] == list(TABLE)  # every step of the table, in order
    row = res.rows[0]
    got = {name: getattr(row, name) for name in COUNTERS}
    assert got == {**EXPECTED, "forward_tokens": FORWARD_TOKENS[cached]}
    assert res.forward_calls == FORWARD_CALLS[cached] == model.calls


@pytest.mark.parametrize("cached", [True, False], ids=["kv", "no-kv"])
def test_a_batch_counts_each_row_as_its_own_hand_count(cached):
    """Two rows of the table in one batch: counters are per row (each equals the hand count),
    ``forward_calls`` is per decode (one forward serves both rows)."""
    model = _TableLM(cached)
    res = decode(model, [[0, 1, 2, 3], [3, 2, 1, 0]], DecodingPolicy(POLICY), 8, kv_cache=cached)
    for row in res.rows:
        assert {name: getattr(row, name) for name in COUNTERS} == {**EXPECTED, "forward_tokens": FORWARD_TOKENS[cached]}
    assert res.forward_calls == FORWARD_CALLS[cached]
