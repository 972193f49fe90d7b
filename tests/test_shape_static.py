"""The shape-static step (issue 25): the captured paths give the tokens and NFE of the eager one.

Equality is checked against the eager decode (itself pinned to the conformance goldens and to
today's behaviour by test_decode*.py and test_step_semantics.py): the whole decode through
``torch.compile(fullgraph=True, dynamic=False)`` (``capture="compile"``, the CPU stand-in for
CUDA graphs: what compiles full-graph reads nothing back to the host), with several forwards
between host reads, with batch buckets and slices, on the conformance fixtures, a shipped
testbed and random models (batch 1/3/8, KV cache on/off, multi-block editing).
"""

from __future__ import annotations

import importlib
import random
from pathlib import Path

import pytest
import torch

from dlm_toolkit import ConfigError, DecodingPolicy, decode
from dlm_toolkit.testing import ScriptedLM, mixing_logits, tiny_llada2

ROOT = Path(__file__).resolve().parents[1]
decode_module = importlib.import_module("dlm_toolkit.decoding.loop")  # the package exports the function by that name
conformance_module = importlib.import_module("dlm_toolkit.evaluation.conformance")


@pytest.fixture(autouse=True)
def _fast_compile(monkeypatch):
    # aot_eager traces the same full graph as inductor (a graph break or host read fails it the
    # same way) without generating C++: seconds instead of minutes on a small CPU
    monkeypatch.setattr(decode_module, "COMPILE_BACKEND", "aot_eager")
    torch.set_num_threads(1)


def same(a, b) -> None:
    assert a.tokens == b.tokens
    assert [r.nfe for r in a.rows] == [r.nfe for r in b.rows]
    for x, y in zip(a.rows, b.rows):
        assert (x.commits, x.edits, x.remasks, x.post_forwards, x.blocks_decoded, x.forward_tokens,
                x.eos_stopped) == (y.commits, y.edits, y.remasks, y.post_forwards, y.blocks_decoded,
                                   y.forward_tokens, y.eos_stopped)


def step_runners(model) -> dict:
    return {k: r for k, r in decode_module.shared(model).items() if k[0] == "step"}


POLICIES = [
    ("llada2.1-q", {}),
    ("llada2.1-s", {"blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 1, "t2t.params.threshold": 0.2}),
    ("llada2.0", {}),
    # three draws per step (sampling, ancestral, ReMDM): each captured rule must use its own draw index
    ("llada2.1-s", {"m2t.name": "ancestral", "m2t.params.steps_per_block": 2, "remask.name": "remdm",
                    "remask.params.eta": 0.5,
                    "sampling.temperature": 1.0}),
]


# each batch size once and each cache mode at two sizes: a (batch, cache) pair gets no code of its own
@pytest.mark.parametrize(("batch", "kv"), [(1, True), (3, False), (8, True), (8, False)],
                         ids=["1-kv", "3-no-kv", "8-kv", "8-no-kv"])
def test_compiled_decode_equals_eager_on_random_models(batch, kv):
    model = tiny_llada2(seed=batch)
    rng = random.Random(batch)
    prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 11))] for _ in range(batch)]
    for preset, overrides in POLICIES:
        policy = DecodingPolicy(preset, **{"blocks.params.block_length": 4, **overrides})
        eager = decode(model, prompts, policy, 12, kv_cache=kv)
        compiled = decode(model, prompts, policy, 12, kv_cache=kv, capture="compile")
        same(eager, compiled)
    runners = step_runners(model)
    assert runners and all(not r.failed for r in runners.values())
    assert all(r.compilations <= 1 for r in runners.values())  # one per (bucket, width, canvas)


@pytest.mark.parametrize("every", [2, 5])
def test_several_forwards_between_host_reads_change_nothing(every):
    model = tiny_llada2(seed=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    for preset, overrides in POLICIES:
        policy = DecodingPolicy(preset, **{"blocks.params.block_length": 4, **overrides})
        for kv in (True, False):
            one = decode(model, prompts, policy, 16, kv_cache=kv)
            many = decode(model, prompts, policy, 16, kv_cache=kv, check_every=every)
            same(one, many)
            assert many.forward_calls >= one.forward_calls  # finished rows may ride along a little longer


def test_a_batch_past_the_largest_bucket_is_split_not_refused(monkeypatch):
    monkeypatch.setattr(decode_module, "BUCKETS", (1, 2))
    model = tiny_llada2(seed=6)
    prompts = [[i + 1, i + 2] for i in range(5)]
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "sampling.temperature": 1.0})
    eager = decode(model, prompts, policy, 8, seed=3)
    split = decode(model, prompts, policy, 8, seed=3, capture="compile", record=True)
    same(eager, split)  # at T = 1: a row keeps its draws in another slice and bucket
    assert {s.row for s in split.trajectory.steps} == set(range(5))
    assert {k[2] for k in step_runners(model)} == {1, 2}  # slices of 2, 2 and 1 rows


def test_one_compilation_per_bucket_and_width_over_many_decodes():
    """The capture contract on the forward: whole decodes over several blocks, batch buckets and
    the KV cache compile the model forward once per (bucket, width) and never fall back."""
    model = tiny_llada2(seed=8)
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4})
    for prompts in ([[1, 2, 3]], [[4, 5, 6]], [[1, 2], [3, 4, 5]], [[7, 8, 9]], [[1], [2], [3]]):
        decode(model, prompts, policy, 9, capture="compile")  # canvas 12, rounded up to 16, for every prompt here
    runners = step_runners(model)
    # buckets 1, 2 and 4; widths B (a step inside a block) and 2B (a block's first step writes the last)
    assert sorted((k[2], k[3]) for k in runners) == [(1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8)]
    assert all(r.compilations == 1 and not r.failed for r in runners.values())


def test_cuda_graphs_need_a_cuda_device():
    model = tiny_llada2(seed=1)
    with pytest.raises(ConfigError, match="^cuda_graphs needs a CUDA device; the model is on cpu$"):
        decode(model, [[1, 2]], "llada2.1-q", 4, cuda_graphs=True)
    with pytest.raises(ConfigError, match="check_every"):
        decode(model, [[1, 2]], "llada2.1-q", 4, check_every=0)
    with pytest.raises(ConfigError, match="capture"):
        decode(model, [[1, 2]], "llada2.1-q", 4, capture="graphs")
    same(decode(model, [[1, 2]], "llada2.1-q", 8, cuda_graphs=False), decode(model, [[1, 2]], "llada2.1-q", 8))


def test_conformance_goldens_pass_through_the_compiled_step(monkeypatch):
    """Every case of both fixtures, token for token and trace for trace, with the KV cache on (the
    captured path of a real decode; the cache-off path is covered by the random models above)."""
    compiled = lambda *a, **k: decode(*a, **k, capture="compile")  # noqa: E731
    monkeypatch.setattr(conformance_module, "decode", compiled)
    for folder in (ROOT / "conformance" / "llada2_tiny", ROOT / "conformance" / "llada2_mask"):
        checks = list(conformance_module.run_conformance(folder, kv_modes=(True,)))
        assert sum(c.decode for c in checks) >= 3
        assert [c.name for c in checks if not c.passed] == []


def test_shipped_testbed_decodes_the_same_compiled():
    from dlm_toolkit.evaluation.evaluate import load_checkpoint

    model, tok = load_checkpoint(ROOT / "checkpoints" / "testbed-v2-editable")
    prompts = [tok.encode(t) for t in ("12+34=", "sort 3 1 2:", "7+8=")]
    for preset in ("llada2.1-q", "llada2.1-s"):
        for kv in (True, False):
            same(decode(model, prompts, preset, 16, kv_cache=kv),
                 decode(model, prompts, preset, 16, kv_cache=kv, capture="compile"))


def test_finished_rows_ride_along_without_changing_anything():
    """Rows that finish early keep forwarding (shapes stay fixed) with nothing written or counted:
    each row of a batch decodes as it does alone, and its NFE is its own."""
    model = ScriptedLM(mixing_logits(40, seed=3), 40, 39, 38)
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4})
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11], [12]]
    batch = decode(model, prompts, policy, 24, seed=[5, 6, 7])
    for i, p in enumerate(prompts):
        alone = decode(model, [p], policy, 24, seed=[5 + i])
        assert batch.rows[i] == alone.rows[0]
    assert len({r.nfe for r in batch.rows}) > 1  # rows did finish at different steps


def test_two_configs_of_one_rule_compiled_on_one_model_each_equal_eager():
    """Two thresholds of the same commit rule, decoded compiled one after
    the other on one model (one store of captured rules), each give their own eager decode: fails
    when the rule-capture key leaves out the rule's config (the second decode replays the first
    one's captured threshold)."""
    model = ScriptedLM(mixing_logits(24, seed=4, scale=2.0, mix=2.0), 24, 23, 22)
    prompts = [[5, 6, 7]]
    low = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "m2t.params.threshold": 0.2})
    high = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "m2t.params.threshold": 0.9})
    eager = [decode(model, prompts, p, 9, capture="eager") for p in (low, high)]
    assert [r.nfe for r in eager[0].rows] != [r.nfe for r in eager[1].rows]  # the configs decode differently
    compiled = [decode(model, prompts, p, 9, capture="compile") for p in (low, high)]
    for e, c in zip(eager, compiled):
        same(e, c)
    rules = {k for k in decode_module.shared(model) if k[0] == "rule"}
    assert len({k[3:5] for k in rules if k[2] == "m2t"}) == 2  # one captured commit rule per config
