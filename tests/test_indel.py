"""Insert/delete edits (issue 26 hook c, :mod:`dlm_toolkit.hooks.indel`) and the ``indel`` T2T rule, each against
an independent reference: the shift against a plain-list walk, the rule against a loop over positions,
two decodes hand-worked step by step on scripted models; plus the engine's guarantees (errors name the
rule and the row, counters, cache on = off, batch invariance, unchanged behaviour when nothing is
proposed)."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from dlm_toolkit import T2T, M2T, ConfigError, DecodingPolicy, StrategyError, decode
from dlm_toolkit.step.flags import pending_payload
from dlm_toolkit.hooks.indel import INDEL, Indel, indel_step
from dlm_toolkit.strategy.registry import REGISTRIES
from dlm_toolkit.step.state import DecodeState
from dlm_toolkit.testing import ScriptedLM, mixing_logits, tiny_llada2
from strategies.blocks_semi_ar import SemiAutoregressive

decode_module = importlib.import_module("dlm_toolkit.decoding.loop")
indel_module = importlib.import_module("dlm_toolkit.hooks.indel")
IndelEdit = T2T.get("indel")
EAGER = {"delete_threshold": 0.3, "insert_threshold": 0.3, "keep_below": 0.95}  # repairs often on a random model


def policy(t2t: str = "indel", block_length: int = 4, preset: str = "llada2.1-q", **params) -> DecodingPolicy:
    return DecodingPolicy(preset, **{"blocks.params.block_length": block_length, "t2t.name": t2t,
                                     **{f"t2t.params.{k}": v for k, v in params.items()}})


# -- the shift against a plain-list walk ------------------------------------------------------------
class _Scripted(Indel):
    """Returns the selections it was built with (no rule logic: the engine's side alone)."""

    name = "_scripted"

    def __init__(self, insert: torch.Tensor, delete: torch.Tensor):
        self.out = (insert, delete)

    def indel(self, ctx):
        return self.out


def reference_shift(block: list[int], insert: list[bool], delete: list[bool], mask: int) -> list[int] | None:
    """The walk of the module docstring on plain lists; None where a written token would fall off."""
    out: list[int] = []
    for tok, ins, dele in zip(block, insert, delete):
        if ins:
            out.append(mask)
        if not dele:
            out.append(tok)
    if any(t != mask for t in out[len(block):]):
        return None
    return out[:len(block)] + [mask] * (len(block) - len(out))


@pytest.mark.parametrize("trial", range(8))
def test_the_shift_equals_a_plain_list_walk(trial):
    """Random canvases and random insert/delete selections over dynamic block bounds (inside or
    overlapping the prompt's tail), windows with padding slots and rows that are not live."""
    rng = random.Random(trial)
    mask, vocab, width = 15, 16, 8
    seen = {"shifted": 0, "overflow": 0, "not live": 0}
    for _ in range(25):
        n = rng.randint(1, 4)
        prompts = [[rng.randrange(0, 14) for _ in range(rng.randint(1, 9))] for _ in range(n)]
        state = DecodeState.start(prompts, rng.randint(3, 12), SemiAutoregressive({"block_length": 4}), mask, 14, vocab,
                                  seed=trial)
        length = state.canvas.shape[1]
        for r in range(n):  # a random canvas: generated positions hold tokens or masks
            for p in range(len(prompts[r]), int(state.length[r])):
                if rng.random() < 0.7:
                    state.canvas[r, p] = rng.randrange(0, 14)
                    state.written_step[r, p] = rng.randint(0, 30)
                    state.written_conf[r, p] = rng.random()
        lo = torch.tensor([rng.randint(max(0, len(p) - 2), int(state.length[r]) - 1) for r, p in enumerate(prompts)])
        hi = torch.tensor([rng.randint(int(lo[r]) + 1, min(int(lo[r]) + width, int(state.length[r]))) for r in range(n)])
        state.block_lo, state.block_hi, state.block_width = lo, hi, width
        state.block_masked = state.masked_in_block(state.all_rows)
        live = torch.tensor([rng.random() < 0.8 for _ in range(n)])
        window_lo = torch.maximum(lo - torch.tensor([rng.randint(0, 3) for _ in range(n)]), torch.zeros_like(lo))
        logits = torch.randn(n, width, vocab)
        pol = policy()  # an insert/delete policy: its context declares ctx.hooks.insert/delete
        ctx = decode_module.step_context(pol, state, live, window_lo, hi, logits)
        ctx.commit = ctx.edit = ctx.remask = torch.zeros_like(ctx.valid)
        rate = rng.choice([0.1, 0.3])
        insert = torch.rand(n, width) < rate
        delete = torch.rand(n, width) < rate
        in_region = ctx.valid & ctx.in_block & ~ctx.is_prompt
        insert &= in_region
        delete &= in_region & (ctx.tokens != mask)
        before = (state.canvas.clone(), state.written_step.clone(), state.written_conf.clone(), state.counts.clone())
        indel_step(state, ctx, _Scripted(insert, delete))
        for r in range(n):
            canvas, step, conf = (t[r].tolist() for t in before[:3])
            start, end = max(int(lo[r]), len(prompts[r])), int(hi[r])
            pos = ctx.positions[r].tolist()
            ins = [bool(insert[r, pos.index(p)]) if p in pos else False for p in range(start, end)]
            dele = [bool(delete[r, pos.index(p)]) if p in pos else False for p in range(start, end)]
            triples = list(zip(canvas[start:end], step[start:end], conf[start:end]))
            if not live[r]:
                want = triples
                seen["not live"] += 1
            else:  # the walk, carrying provenance along with each token
                out: list[tuple] = []
                for t, i, d in zip(triples, ins, dele):
                    if i:
                        out.append((mask, -1, 0.0))
                    if not d:
                        out.append(t)
                overflow = any(t[0] != mask for t in out[end - start:])
                want = triples if overflow else out[:end - start] + [(mask, -1, 0.0)] * (end - start - len(out))
                assert (pending_payload(state, INDEL) is not None and int(pending_payload(state, INDEL)[r, 0]) == 3) == overflow
                toks = reference_shift(canvas[start:end], ins, dele, mask)
                assert (toks is None) == overflow and (overflow or toks == [t[0] for t in want])
                applied = not overflow
                seen["overflow" if overflow else "shifted"] += applied and (any(ins) or any(dele)) or overflow
                assert int(state.counts[r, -2] - before[3][r, -2]) == (sum(ins) if applied else 0)
                assert int(state.counts[r, -1] - before[3][r, -1]) == (sum(dele) if applied else 0)
            got = list(zip(state.canvas[r, start:end].tolist(), state.written_step[r, start:end].tolist(),
                           state.written_conf[r, start:end].tolist()))
            assert got == want, (r, start, end, ins, dele)
            outside = [p for p in range(length) if not start <= p < end]
            assert state.canvas[r, outside].tolist() == [canvas[p] for p in outside], "a position outside the block moved"
        assert torch.equal(state.block_masked, state.masked_in_block(state.all_rows)), "block_masked lost count"
    assert all(seen.values()), seen


# -- errors name the rule and the row ---------------------------------------------------------------
class _Overflows(IndelEdit):  # inserts before the first generated slot of row 1's block, room or not
    def indel(self, ctx):
        region = indel_module.indel_region(ctx) & (ctx.rows == 1)[:, None]
        return region & (region.long().cumsum(1) == 1), torch.zeros_like(region)


class _DeletesThePrompt(IndelEdit):
    def indel(self, ctx):
        return torch.zeros_like(ctx.valid), ctx.valid & ctx.is_prompt & (ctx.rows == 2)[:, None]


class _ReturnsFloats(IndelEdit):
    def indel(self, ctx):
        return torch.zeros_like(ctx.confidence), torch.zeros_like(ctx.confidence)


def registered(cls, name):
    if name not in T2T.names():  # registered now, not at import: other files list the registered rules
        T2T.register(name)(cls)
    return name


def scripted_model(seed=0):
    return ScriptedLM(mixing_logits(24, seed=seed, scale=2.5, mix=2.0), 24, 23, 22)


def test_an_insert_into_a_full_block_raises_naming_the_rule_row_and_block():
    name = registered(_Overflows, "_indel_overflows")
    with pytest.raises(StrategyError, match=rf"t2t rule '{name}' inserted into the active block \[\d+, \d+\) of batch row 1 "
                                            r"more masks than its end could absorb"):
        decode(scripted_model(), [[1, 2, 3], [4, 5], [6]], policy(name), 8)


def test_a_delete_of_a_prompt_token_raises_naming_the_rule_and_row():
    name = registered(_DeletesThePrompt, "_indel_deletes_prompt")
    with pytest.raises(StrategyError, match=rf"t2t rule '{name}' asked to delete position \d+, outside what the active "
                                            r"block \[\d+, \d+\) of batch row 2 allows"):
        decode(scripted_model(), [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], policy(name), 8)


def test_a_rule_returning_floats_is_refused_naming_it():
    name = registered(_ReturnsFloats, "_indel_floats")
    with pytest.raises(StrategyError, match=rf"t2t rule '{name}': indel\(\) must return \(insert, delete\), two bool"):
        decode(scripted_model(), [[1, 2, 3]], policy(name), 4)


def test_an_indel_on_a_commit_rule_is_refused():
    class _CommitIndel(M2T.get("threshold"), Indel):
        pass

    if "_indel_m2t" not in M2T.names():
        M2T.register("_indel_m2t")(_CommitIndel)
    with pytest.raises(ConfigError, match="m2t rule '_indel_m2t' is an Indel"):
        DecodingPolicy("llada2.1-q", **{"m2t.name": "_indel_m2t"})


# -- hand-worked decodes on scripted models ----------------------------------------------------------
V, MASK, EOS = 16, 15, 14
A, B_, C, D, E, F, X = 1, 2, 3, 4, 5, 6, 7


def lookup_model(table: dict[tuple, list[tuple[int, float]]], lo: int, hi: int, seen: list[tuple]) -> ScriptedLM:
    """A model whose logits at the block [lo, hi) are looked up by the block's content: ``(token,
    probability)`` per position (the rest spread evenly over the other non-mask tokens). A content
    not in ``table`` fails the test: the decode left the hand-worked path."""

    def fn(ids, pos, attn):
        out = torch.zeros(*ids.shape, V)
        for b in range(ids.shape[0]):
            where = [i for i, p in enumerate(pos[b].tolist()) if lo <= p < hi]
            block = tuple(int(ids[b, i]) for i in where)
            assert block in table, f"unexpected block content {block}"
            seen.append(block)
            for i, (tok, p) in zip(where, table[block]):
                row = torch.full((V,), (1 - p) / (V - 2)).log()
                row[tok], row[MASK] = torch.tensor(p).log(), -torch.inf
                out[b, i] = row
        return out

    return ScriptedLM(fn, V, MASK, EOS)


def sure(*tokens):
    return [(t, 0.99) for t in tokens]


def test_a_stutter_is_deleted_and_the_gap_filled():
    """``a b b c``: the model (which wants ``a b c d``) puts ``c`` at the second ``b`` (the token after
    it) and doubts that ``b``: delete it -> ``a b c [mask]``, not a substitution of ``b c`` into ``c d``;
    the next step fills the mask, the post step converges."""
    m = MASK
    table = {(m, m, m, m): sure(A, B_, B_, C),
             (A, B_, B_, C): sure(A, B_, C, D),
             (A, B_, C, m): sure(A, B_, C, D),
             (A, B_, C, D): sure(A, B_, C, D)}
    seen: list[tuple] = []
    res = decode(lookup_model(table, 4, 8, seen), [[8, 9, 10, 11]], policy(), 4, record=True)
    assert seen == [(m, m, m, m), (A, B_, B_, C), (A, B_, C, m), (A, B_, C, D)]
    assert res.tokens == [[A, B_, C, D]]
    row = res.rows[0]
    assert (row.nfe, row.deletes, row.inserts, row.edits) == (4, 1, 0, 0)
    steps = res.trajectory.for_row(0)
    assert [s.delete for s in steps] == [[], [6], [], []]
    assert steps[1].block_after == [A, B_, C, m] and steps[1].edit == []


def test_a_gap_gets_a_mask_inserted_and_filled():
    """``a c d`` then masks: the model wants ``a b c d e f``, puts ``c`` at the ``d`` and doubts the ``c``:
    insert a mask before ``c`` (the block's last mask absorbs the shift; the step's own commit ``x`` at
    position 9 moves along to 10) -> ``a [m] c d x [m]``; then ``b`` and ``f`` are committed and ``x`` is
    edited to ``e``."""
    m = MASK
    low = [(X, 0.4), (X, 0.3), (X, 0.2)]
    table = {(m,) * 6: sure(A, C, D) + low,
             (A, C, D, m, m, m): sure(A, B_, C) + low,
             (A, m, C, D, X, m): sure(A, B_, C, D, E, F),
             (A, B_, C, D, E, F): sure(A, B_, C, D, E, F)}
    seen: list[tuple] = []
    res = decode(lookup_model(table, 6, 12, seen), [[8, 9, 10, 11, 12, 13]], policy(block_length=6), 6, record=True)
    assert seen == list(table)
    assert res.tokens == [[A, B_, C, D, E, F]]
    row = res.rows[0]
    assert (row.nfe, row.inserts, row.deletes, row.edits) == (4, 1, 0, 1)
    steps = res.trajectory.for_row(0)
    assert [s.insert for s in steps] == [[], [7], [], []]
    assert steps[1].commit == [9] and steps[1].edit == [] and steps[1].block_after == [A, m, C, D, X, m]


def test_a_repeated_token_the_model_agrees_with_is_kept():
    """``a b b c`` where the model wants exactly that, doubting the first ``b`` a little (0.6 < keep_below
    0.9, above both thresholds): its argmax at the first ``b`` is the next token, ``b``, but also the token
    already there, so nothing is deleted (and no insert before the second ``b`` either)."""
    m = MASK
    want = [(A, 0.99), (B_, 0.6), (B_, 0.6), (C, 0.99)]
    table = {(m, m, m, m): want, (A, B_, B_, C): want}
    seen: list[tuple] = []
    loose = {"delete_threshold": 0.5, "insert_threshold": 0.5, "keep_below": 0.9}
    res = decode(lookup_model(table, 4, 8, seen), [[8, 9, 10, 11]], policy(preset="llada2.1-s", **loose), 4)
    assert seen == [(m, m, m, m), (A, B_, B_, C)] and res.tokens == [[A, B_, B_, C]]
    assert (res.rows[0].deletes, res.rows[0].inserts) == (0, 0)
    # the same with room for an insert (the block's last slot still masked): nothing inserted either
    want = [(A, 0.99), (B_, 0.6), (B_, 0.6), (C, 0.99), (D, 0.3), (E, 0.2)]
    table = {(m,) * 6: want, (A, B_, B_, C, m, m): want, (A, B_, B_, C, D, m): want, (A, B_, B_, C, D, E): want}
    seen.clear()
    res = decode(lookup_model(table, 6, 12, seen), [[8, 9, 10, 11, 12, 13]], policy(block_length=6, preset="llada2.1-s", **loose), 6)
    assert seen == list(table) and res.tokens == [[A, B_, B_, C, D, E]]
    assert (res.rows[0].deletes, res.rows[0].inserts) == (0, 0)


# -- the rule against a loop over positions ----------------------------------------------------------
def reference_repairs(ctx, cfg, changed, after) -> tuple[set, set]:
    """``(insert slots, delete slots)`` of the rule (strategies/t2t_indel.py), written as loops."""
    ins, dels = set(), set()
    mask = ctx.mask_token_id
    probs = ctx.probs.tolist()
    for b in range(ctx.batch_size):
        w = ctx.width
        tok = ctx.tokens[b].tolist()
        region = [bool(ctx.valid[b, j] and ctx.in_block[b, j] and not ctx.is_prompt[b, j] and ctx.live[b]) for j in range(w)]
        still = [region[j] and tok[j] != mask and not changed[b][j] and int(ctx.block_step[b]) < cfg.indel_steps
                 for j in range(w)]
        best = [max(range(len(p)), key=lambda v, p=p: (p[v], -v)) for p in probs[b]]
        best_p = [probs[b][j][best[j]] for j in range(w)]
        conf = [probs[b][j][tok[j]] for j in range(w)]
        last = max((j for j in range(w) if region[j]), default=None)
        room = last is not None and after[b][last] == mask
        deletes, inserts = [], []
        for j in range(w - 1):
            if not (still[j] and still[j + 1] and conf[j] < cfg.keep_below):
                continue
            if best[j] == tok[j + 1] != tok[j] and best_p[j] > cfg.delete_threshold:
                deletes.append((best_p[j], -j, j))
            if room and best[j + 1] == tok[j] != tok[j + 1] and best_p[j + 1] > cfg.insert_threshold:
                inserts.append((best_p[j + 1], -j, j))
        if deletes:
            dels.add((b, max(deletes)[2]))
        elif inserts:
            ins.add((b, max(inserts)[2]))
    return ins, dels


def test_the_rule_equals_a_loop_over_positions_in_decodes_of_a_random_model(monkeypatch):
    calls = {"steps": 0, "repairs": 0}
    original = indel_module.indel_step

    def checking(state, ctx, r):
        changed = (ctx.commit | ctx.edit | ctx.remask).tolist()
        after = indel_module.written_window(ctx).tolist()
        want_ins, want_del = reference_repairs(ctx, r.config, changed, after)
        insert, delete = r.indel(ctx)
        assert {tuple(x) for x in insert.nonzero().tolist()} == want_ins
        assert {tuple(x) for x in delete.nonzero().tolist()} == want_del
        # the substitution edit: threshold, except the slots j and j+1 of the repair chosen before the write
        commit_only = torch.where(ctx.commit, ctx.sampled, ctx.tokens).tolist()
        pre_ins, pre_del = reference_repairs(ctx, r.config, [[False] * ctx.width] * ctx.batch_size, commit_only)
        involved = {(b, j + k) for b, j in pre_ins | pre_del for k in (0, 1)}
        plain = ctx.editable & (ctx.sampled != ctx.tokens) & (ctx.confidence > r.config.threshold)
        want_edit = {tuple(x) for x in plain.nonzero().tolist()} - involved
        assert {tuple(x) for x in ctx.edit.nonzero().tolist()} == want_edit
        calls["steps"] += 1
        calls["repairs"] += len(want_ins) + len(want_del)
        return original(state, ctx, r)

    monkeypatch.setattr(indel_module, "indel_step", checking)  # IndelHook.after_write calls it
    for seed in range(3):
        rng = random.Random(seed)
        prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 7))] for _ in range(3)]
        decode(tiny_llada2(seed=seed), prompts, policy(**EAGER), 10, seed=seed)
    assert calls["repairs"] > 0 and calls["steps"] > 10, calls


# -- counters, bounds, unchanged behaviour, cache and batch ------------------------------------------
def test_counters_follow_the_trajectory_and_block_masked_stays_exact(monkeypatch):
    original = indel_module.indel_step

    def checking(state, ctx, r):
        original(state, ctx, r)
        live = state.all_rows[~state.done]
        assert torch.equal(state.block_masked[live], state.masked_in_block(live)), "block_masked drifted from the canvas"

    monkeypatch.setattr(indel_module, "indel_step", checking)  # IndelHook.after_write calls it
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    res = decode(tiny_llada2(seed=1), prompts, policy(**EAGER), 12, record=True)
    assert sum(r.deletes + r.inserts for r in res.rows) > 0, "nothing inserted or deleted: the test checks nothing"
    for i, row in enumerate(res.rows):
        steps = res.trajectory.for_row(i)
        assert row.inserts == sum(len(s.insert) for s in steps)
        assert row.deletes == sum(len(s.delete) for s in steps)
        assert 63 not in row.tokens, "the decode finished with a mask left"
    summary = res.summary()
    gen = sum(len(r.tokens) for r in res.rows)
    assert summary["deletes_per_token"] == pytest.approx(sum(r.deletes for r in res.rows) / gen)


def shifting_model() -> ScriptedLM:
    """A model that always wants the next written token one place to the left (whatever it is shown),
    else a token of its own per position: a delete rule sees a stutter at every step, forever."""

    def fn(ids, pos, attn):
        out = torch.zeros(*ids.shape, V)
        nxt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], MASK)], 1)
        own = pos % 10
        target = torch.where((nxt != MASK) & (nxt != ids), nxt, own)
        out.scatter_(-1, target[..., None], 5.0)
        out[..., MASK] = -torch.inf
        return out

    return ScriptedLM(fn, V, MASK, EOS)


def test_deletes_every_step_stay_within_the_forward_bound():
    """A rule that deletes whenever it may (any stutter, any confidence), on a model that shows it a
    stutter at every step, still finishes: its deletes stop after ``indel_steps`` forwards of a block,
    within the bound the engine adds for them."""
    greedy = {"delete_threshold": 0.0, "insert_threshold": 0.0, "keep_below": 1.0, "indel_steps": 6}
    res = decode(shifting_model(), [[1, 2, 3], [4]], policy(**greedy), 8)
    assert all(r.deletes >= 6 for r in res.rows), [r.deletes for r in res.rows]  # one per forward while allowed
    assert all(MASK not in r.tokens for r in res.rows)


@pytest.mark.parametrize("preset", ["llada2.1-q", "llada2.1-s"])
def test_a_rule_that_never_repairs_decodes_as_the_threshold_edit(preset):
    never = {"delete_threshold": 1.0, "insert_threshold": 1.0}
    for model, prompts in ((tiny_llada2(seed=2), [[3, 4, 5], [6, 7], [8]]), (scripted_model(3), [[1, 2], [3, 4, 5, 6]])):
        a = decode(model, prompts, policy("threshold", preset=preset), 10)
        b = decode(model, prompts, policy(preset=preset, **never), 10)
        assert a.tokens == b.tokens
        assert [(r.nfe, r.edits, r.commits) for r in a.rows] == [(r.nfe, r.edits, r.commits) for r in b.rows]
        assert all(r.inserts == r.deletes == 0 for r in b.rows)


@pytest.mark.parametrize("blocks", [{}, {"blocks.name": "dsb", "blocks.params.block_length": 4, "blocks.params.max_block_length": 8},
                                    {"blocks.name": "multi_block_edit", "blocks.params.block_length": 4}])
def test_cache_on_equals_off_and_rows_decode_as_alone(blocks):
    pol = DecodingPolicy(policy(**EAGER).config, **blocks)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15]]
    model = tiny_llada2(seed=4)
    on = decode(model, prompts, pol, 10, seed=3)
    off = decode(model, prompts, pol, 10, seed=3, kv_cache=False)
    counts = [[(r.nfe, r.inserts, r.deletes) for r in res.rows] for res in (on, off)]
    assert on.tokens == off.tokens and counts[0] == counts[1]
    assert sum(r.inserts + r.deletes for r in on.rows) > 0
    alone = decode(model, prompts[1:2], pol, 10, seed=[on_seed(3, 1)])
    assert alone.tokens[0] == on.tokens[1] and (alone.rows[0].nfe, alone.rows[0].deletes) == (on.rows[1].nfe, on.rows[1].deletes)


def test_one_host_read_per_step_with_inserts_and_deletes():
    """The rule, the shift and its error flag add no host read: still one per forward."""
    from dlm_toolkit.testing import HostSyncs

    pol = DecodingPolicy(policy(**EAGER).config, **{"blocks.params.eos_early_stop": False})
    model, counts = tiny_llada2(seed=1), []
    for gen in (8, 16):
        with HostSyncs() as syncs:
            res = decode(model, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], pol, gen)
        counts.append((syncs.count, res.forward_calls, sum(r.deletes + r.inserts for r in res.rows)))
    (c1, f1, _), (c2, f2, shifts) = counts
    assert shifts > 0 and f2 > f1 and (c2 - c1) / (f2 - f1) == 1


def test_compiled_decode_equals_eager(monkeypatch):
    monkeypatch.setattr(decode_module, "COMPILE_BACKEND", "aot_eager")  # the same graph, no codegen
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    model = tiny_llada2(seed=4)
    eager = decode(model, prompts, policy(**EAGER), 8)
    compiled = decode(model, prompts, policy(**EAGER), 8, capture="compile")
    assert eager.tokens == compiled.tokens
    assert [(r.nfe, r.inserts, r.deletes) for r in eager.rows] == [(r.nfe, r.inserts, r.deletes) for r in compiled.rows]
    assert sum(r.deletes + r.inserts for r in eager.rows) > 0


def on_seed(seed, row):
    from dlm_toolkit.step.state import row_seed

    return row_seed(seed, row)


# -- registry and config ---------------------------------------------------------------------------
def test_registered_and_usable_by_name_in_a_policy_dict():
    assert "indel" in REGISTRIES["t2t"].names()
    pol = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.7}},
                          "t2t": {"name": "indel", "params": {"delete_threshold": 0.8}},
                          "blocks": {"name": "semi_ar", "params": {"block_length": 4}}})
    assert isinstance(pol.t2t, IndelEdit) and pol.t2t.config.delete_threshold == 0.8 and pol.t2t.config.threshold == 0.5
    assert decode(scripted_model(), [[1, 2, 3]], pol, 6).tokens


@pytest.mark.parametrize("field, bad, allowed", [("delete_threshold", 1.5, "0.0 <= x <= 1.0"),
                                                 ("insert_threshold", -0.1, "0.0 <= x <= 1.0"),
                                                 ("keep_below", 2, "0.0 <= x <= 1.0"),
                                                 ("indel_steps", -1, "0 <= x <= 4096"),
                                                 ("threshold", 1.1, "0.0 <= x <= 1.0")])
def test_bad_config_values_name_the_field_and_range(field, bad, allowed):
    with pytest.raises(ConfigError, match=rf"t2t.params.{field}: .*allowed: {allowed}"):
        DecodingPolicy("llada2.1-q", **{"t2t.name": "indel", f"t2t.params.{field}": bad})


def test_evaluate_reports_the_inserts_and_deletes_a_plain_decode_counts():
    """``evaluate`` (and so ``dlm eval``, sweeps, the catalogue) reports inserts/deletes per token: the
    reference is one plain decode of the same prompts and row seeds, counted by hand."""
    import sweep_helpers as h
    from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint, task_prompt
    from dlm_toolkit.step.state import row_seed
    from dlm_toolkit.tasks import get_task

    model, tok = load_checkpoint(h.checkpoint())
    pol = policy(block_length=8, preset="llada2.1-s", **EAGER)
    n, seed = 6, 3
    metrics = evaluate(model, tok, "add", pol, n, seed, batch_size=4, progress=False).metrics
    task = get_task("add")
    prompts = [task_prompt(tok, task, inst, False) for inst in task.instances(n, seed, "eval")]
    rows = decode(model, prompts, pol, task.answer_length + 1, seed=[row_seed(seed, i) for i in range(n)]).rows
    tokens = sum(len(r.tokens) for r in rows)
    assert sum(r.inserts + r.deletes for r in rows) > 0, "nothing inserted or deleted: the test checks nothing"
    assert metrics["inserts_per_token"] == pytest.approx(sum(r.inserts for r in rows) / tokens)
    assert metrics["deletes_per_token"] == pytest.approx(sum(r.deletes for r in rows) / tokens)
