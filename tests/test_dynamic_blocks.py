"""DSB (arXiv 2602.05992) and the dynamic-block hook: the block-size rule against a plain-Python
reimplementation of the paper's pointer updates, and the decode properties every schedule must
keep (KV cache on == off, batch invariance, compiled == eager), plus bad input."""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch

from dlm_toolkit import ConfigError, DecodingPolicy, StrategyError, decode
from dlm_toolkit.strategy.registry import BLOCKS
from dlm_toolkit.testing import ScriptedLM, mixing_logits, tiny_llada2

decode_module = importlib.import_module("dlm_toolkit.decoding.loop")
VOCAB, MASK, EOS = 24, 23, 22


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setattr(decode_module, "COMPILE_BACKEND", "aot_eager")  # same full graph, no codegen
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dsb_policy(threshold: float = 0.5, **blocks) -> DecodingPolicy:
    return DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": threshold}},
                           "blocks": {"name": "dsb", "params": blocks}})


# -- the paper's rule, by brute force ---------------------------------------------------------------


def brute_force_dsb(fn, prompt: list[int], gen: int, tau: float, bl: int, end_rule, post_steps: int):
    """One row decoded by a plain loop: forward the canvas up to the block's end with the attention
    the schedule documents (final positions by their ``bl`` grid block, the active block one group
    above them), commit masks with confidence > ``tau`` (else the single most confident one), then
    move the block: start = first masked position of the block (its end if none), end =
    ``end_rule(start, end, n_committed)`` capped at prompt + gen. Returns tokens, NFE, windows."""
    x = list(prompt) + [MASK] * gen
    p, gen_end = len(prompt), len(prompt) + gen
    lo, hi = p, min(p + bl, gen_end)
    nfe, windows = 0, []
    while True:
        def group(j):
            return j // bl if j < lo else lo // bl + 1
        attn = torch.tensor([[group(k) <= group(q) for k in range(hi)] for q in range(hi)])
        logits = fn(torch.tensor([x[:hi]]), torch.tensor([list(range(hi))]), attn[None])[0]
        nfe += 1
        windows.append((lo, hi))
        masked = [j for j in range(lo, hi) if x[j] == MASK]
        if not masked:  # the last block holds no mask: one post forward, which edits nothing (no T2T rule)
            if post_steps == 0:
                nfe -= 1  # the engine checks the post budget before forwarding
                windows.pop()
            break
        token, conf = {}, {}
        for j in masked:
            probs = [math.exp(v) for v in logits[j].tolist()]
            total = sum(probs)
            best = max((v for v in range(VOCAB) if v != MASK), key=lambda v: probs[v])
            token[j], conf[j] = best, probs[best] / total
        commit = [j for j in masked if conf[j] > tau] or [max(masked, key=lambda j: (conf[j], -j))]
        for j in commit:
            x[j] = token[j]
        still = [j for j in range(lo, hi) if x[j] == MASK]
        start = still[0] if still else hi
        if start >= gen_end:
            lo, hi = lo, hi  # stay: the next pass finds no mask
            continue
        lo, hi = start, min(end_rule(start, hi, len(commit)), gen_end)
    return x[p:gen_end], nfe, windows


def _engine(fn, prompts, gen, tau, **blocks):
    model = ScriptedLM(fn, VOCAB, MASK, EOS)
    res = decode(model, prompts, dsb_policy(tau, eos_early_stop=False, **blocks), gen, record=True)
    windows: dict[int, list[tuple[int, int]]] = {}
    for s in res.trajectory.steps:
        windows.setdefault(s.row, []).append((min(s.positions), max(s.positions) + 1))
    return res, windows


CASES = [  # (seed, block_length, threshold, prompt lengths, gen)
    (0, 4, 0.5, [3, 9], 21), (1, 3, 0.3, [1, 7, 12], 17), (2, 5, 0.6, [6], 24), (3, 4, 0.2, [2, 5], 30),
]


@pytest.mark.parametrize("seed, bl, tau, lengths, gen", CASES)
def test_const_variant_is_the_papers_sliding_block(seed, bl, tau, lengths, gen):
    """``max_block_length == block_length`` is DSB (const.): the block keeps its length and its start
    jumps to the first masked position (``generate_s_cache``: end = start + block_length)."""
    fn = mixing_logits(VOCAB, seed=seed, scale=2.5, mix=2.0)
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 22) for _ in range(n)] for n in lengths]
    res, windows = _engine(fn, prompts, gen, tau, block_length=bl, max_block_length=bl, max_post_steps=0)
    for r, p in enumerate(prompts):
        tokens, nfe, wins = brute_force_dsb(fn, p, gen, tau, bl, lambda s, e, n: s + bl, post_steps=0)
        assert res.canvas[r, len(p):len(p) + gen].tolist() == tokens
        assert res.rows[r].nfe == nfe
        assert windows[r] == wins


@pytest.mark.parametrize("seed, bl, tau, lengths, gen", CASES)
def test_greedy_variant_grows_the_block_by_its_commits(seed, bl, tau, lengths, gen):
    """With a cap that never binds (``max_block_length >= gen_length``) this is DSB (greedy):
    ``generate_i_cache``'s end += number committed, start = first masked position."""
    fn = mixing_logits(VOCAB, seed=seed, scale=2.5, mix=2.0)
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 22) for _ in range(n)] for n in lengths]
    res, windows = _engine(fn, prompts, gen, tau, block_length=bl, max_block_length=gen, max_post_steps=3)
    grew = False
    for r, p in enumerate(prompts):
        tokens, nfe, wins = brute_force_dsb(fn, p, gen, tau, bl, lambda s, e, n: e + n, post_steps=3)
        assert res.canvas[r, len(p):len(p) + gen].tolist() == tokens
        assert res.rows[r].nfe == nfe
        assert windows[r] == wins
        grew |= any(hi - lo > bl for lo, hi in wins)
    assert grew, "no block ever grew: the case does not exercise the greedy rule"


@pytest.mark.parametrize("seed, bl, tau, lengths, gen", CASES)
def test_capped_variant(seed, bl, tau, lengths, gen):
    """Between the two (our default shape, cap 2 × block_length): end = min(max(end + n, start + bl),
    start + cap)."""
    fn = mixing_logits(VOCAB, seed=seed, scale=2.5, mix=2.0)
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 22) for _ in range(n)] for n in lengths]
    cap = bl + 2
    res, windows = _engine(fn, prompts, gen, tau, block_length=bl, max_block_length=cap, max_post_steps=0)
    for r, p in enumerate(prompts):
        def rule(s, e, n):
            return min(max(e + n, s + bl), s + cap)
        tokens, nfe, wins = brute_force_dsb(fn, p, gen, tau, bl, rule, post_steps=0)
        assert res.canvas[r, len(p):len(p) + gen].tolist() == tokens
        assert res.rows[r].nfe == nfe
        assert windows[r] == wins


def test_dsb_changes_the_decode_against_fixed_blocks():
    """The same commit rule under semi_ar and under DSB: different windows, so the schedule matters
    (a DSB that silently fell back to fixed blocks would pass the checks above only by accident)."""
    fn = mixing_logits(VOCAB, seed=5, scale=2.5, mix=2.0)
    model = ScriptedLM(fn, VOCAB, MASK, EOS)
    prompts = [[1, 2, 3, 4, 5]]
    fixed = decode(model, prompts, {"m2t": {"name": "threshold", "params": {"threshold": 0.5}},
                                    "blocks": {"name": "semi_ar", "params": {"block_length": 4, "max_post_steps": 0}}},
                   20, record=True)
    dsb = decode(model, prompts, dsb_policy(block_length=4, max_block_length=8, max_post_steps=0), 20, record=True)
    assert [s.positions for s in fixed.trajectory.steps] != [s.positions for s in dsb.trajectory.steps]


# -- decode properties ---------------------------------------------------------------------------------


DECODE_POLICIES = [
    {"block_length": 4, "max_block_length": 8, "max_post_steps": 2},
    {"block_length": 4, "max_block_length": 4, "max_post_steps": 0},
    {"block_length": 3, "max_block_length": 9, "max_post_steps": 1, "eos_early_stop": False},
]


def full_policy(blocks: dict, t2t: float = 0.6) -> DecodingPolicy:
    return DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.4}},
                           "t2t": {"name": "threshold", "params": {"threshold": t2t}},
                           "remask": {"name": "low_confidence", "params": {"threshold": 0.2}},
                           "blocks": {"name": "dsb", "params": blocks}})


def same(a, b) -> None:
    assert a.tokens == b.tokens
    for x, y in zip(a.rows, b.rows):
        assert (x.nfe, x.commits, x.edits, x.remasks, x.post_forwards, x.blocks_decoded, x.eos_stopped) == (
            y.nfe, y.commits, y.edits, y.remasks, y.post_forwards, y.blocks_decoded, y.eos_stopped)


@pytest.mark.parametrize("blocks", DECODE_POLICIES)
def test_cache_on_equals_cache_off(blocks):
    model = tiny_llada2(seed=3)
    rng = random.Random(len(str(blocks)))
    prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 13))] for _ in range(4)]
    policy = full_policy(blocks)
    on = decode(model, prompts, policy, 19, kv_cache=True)
    off = decode(model, prompts, policy, 19, kv_cache=False)
    same(on, off)
    assert on.rows[0].forward_tokens < off.rows[0].forward_tokens  # the cache did hold the prefix


@pytest.mark.parametrize("blocks", DECODE_POLICIES)
def test_batch_rows_decode_as_alone(blocks):
    model = tiny_llada2(seed=4)
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 60) for _ in range(n)] for n in (2, 9, 5)]
    policy = full_policy(blocks)
    batch = decode(model, prompts, policy, 15, seed=3)
    from dlm_toolkit.step.state import row_seed

    for i, p in enumerate(prompts):
        alone = decode(model, [p], policy, 15, seed=[row_seed(3, i)])
        assert alone.tokens[0] == batch.tokens[i]
        assert alone.rows[0].nfe == batch.rows[i].nfe


@pytest.mark.parametrize("kv", [True, False], ids=["kv", "no-kv"])
def test_compiled_equals_eager_with_one_compilation_per_width(kv):
    model = tiny_llada2(seed=5)
    rng = random.Random(5)
    prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 11))] for _ in range(3)]
    policy = full_policy({"block_length": 4, "max_block_length": 8, "max_post_steps": 1})
    eager = decode(model, prompts, policy, 14, kv_cache=kv)
    compiled = decode(model, prompts, policy, 14, kv_cache=kv, capture="compile")
    same(eager, compiled)
    every = decode(model, prompts, policy, 14, kv_cache=kv, capture="compile", check_every=3)
    same(eager, every)
    runners = {k: r for k, r in decode_module.shared(model).items() if k[0] == "step"}
    assert runners and all(not r.failed for r in runners.values())
    assert all(r.compilations <= 1 for r in runners.values())  # one per (bucket, width, canvas)
    if kv:  # the window (8) and the window plus the partly final grid block (8 + 4): nothing else
        assert {k[3] for k in runners} <= {8, 12}


# -- bad input -------------------------------------------------------------------------------------------


class _StartsInPrompt(BLOCKS.get("dsb")):
    def first_bounds(self, state):
        lo, hi = super().first_bounds(state)
        return lo - 1, hi


class _RunsOffCanvas(BLOCKS.get("dsb")):
    def next_bounds(self, state, ctx):
        lo, hi = super().next_bounds(state, ctx)
        return lo, torch.where(hi >= state.gen_end, state.length + 1, hi)  # the last block overshoots


@pytest.mark.parametrize("kv", [True, False])
def test_block_overlapping_the_prompt_is_refused(kv):
    policy = DecodingPolicy({"m2t": {"name": "threshold"}, "blocks": {"name": f"{__name__}:_StartsInPrompt", "params": {"block_length": 4,
                                                                                              "max_block_length": 8}}})
    with pytest.raises(StrategyError, match=r"block schedule '.*_StartsInPrompt' proposed the active block \[4, 9\) "
                                            r"for batch row 0, which overlaps the prompt"):
        decode(tiny_llada2(seed=1), [[1, 2, 3, 4, 5]], policy, 12, kv_cache=kv)


def test_block_leaving_the_canvas_is_refused():
    policy = DecodingPolicy({"m2t": {"name": "threshold"}, "blocks": {"name": f"{__name__}:_RunsOffCanvas", "params": {"block_length": 4,
                                                                                             "max_block_length": 8}}})
    with pytest.raises(StrategyError, match=r"block schedule '.*_RunsOffCanvas' proposed the active block .* "
                                            r"leaves the canvas \[0, 16\)"):
        decode(tiny_llada2(seed=1), [[1, 2, 3, 4, 5]], policy, 9)


def test_max_block_shorter_than_block_is_refused():
    with pytest.raises(ConfigError, match="max_block_length"):
        dsb_policy(block_length=8, max_block_length=4)


def test_catalogue_sweep_offers_dsb_with_valid_largest_blocks():
    from pathlib import Path

    import yaml

    space = yaml.safe_load((Path(__file__).resolve().parents[1] / "experiments" / "catalogue.yaml").read_text())["search_space"]
    assert "dsb" in space["blocks.name"]["categorical"]
    largest = space["blocks.params.max_block_length"]
    assert largest["when"] == {"blocks.name": "dsb"}
    assert min(largest["categorical"]) >= max(space["blocks.params.block_length"]["categorical"])


def test_eos_early_stop_ends_the_row_once_an_eos_is_final():
    """An EOS behind the block is final: the row stops there (fewer forwards, same output) instead
    of decoding the rest of the canvas."""
    from dlm_toolkit.testing import table_logits

    gen = torch.Generator().manual_seed(0)
    table = torch.randn(64, VOCAB, generator=gen)
    table[:, EOS] = -9.0
    table[7, EOS] = 9.0  # the third generated position of a 5-token prompt
    model = ScriptedLM(table_logits(table), VOCAB, MASK, EOS)
    prompts = [[1, 2, 3, 4, 5]]
    kwargs = {"block_length": 4, "max_block_length": 8, "max_post_steps": 0}
    stop = decode(model, prompts, dsb_policy(0.5, eos_early_stop=True, **kwargs), 24)
    run = decode(model, prompts, dsb_policy(0.5, eos_early_stop=False, **kwargs), 24)
    assert stop.tokens == run.tokens and stop.tokens[0][-1] == EOS and len(stop.tokens[0]) == 3
    assert stop.rows[0].eos_stopped and not run.rows[0].eos_stopped
    assert stop.rows[0].nfe < run.rows[0].nfe
    assert (stop.canvas[0, 5:29] == MASK).any()  # the rest of the generation was never decoded
