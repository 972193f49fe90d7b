"""The catalogue of commit / edit / remask rules on hand-built logits with known probabilities."""

import math

import pytest
import torch

from dlm_toolkit import Selection
from dlm_toolkit.strategy.registry import M2T, REMASK, T2T
from dlm_toolkit.strategy.selection import entropy
from dlm_toolkit.testing import make_context

M = 9  # mask id in a 10-token vocab


def dist(*probs_rows: list[float], vocab: int = 10) -> torch.Tensor:
    """(1, W, V) logits = log(probs) for explicit distributions over the first tokens (rest 0)."""
    rows = []
    for probs in probs_rows:
        p = torch.zeros(vocab)
        p[: len(probs)] = torch.tensor(probs, dtype=torch.float64)
        rows.append(torch.log(p).float())
    return torch.stack(rows)[None]


def conf(*pairs: tuple[float, int], vocab: int = 10) -> torch.Tensor:
    """(1, W, V) logits giving token t probability p, the rest spread evenly (over non-mask tokens)."""
    rows = []
    for p, t in pairs:
        row = torch.full((vocab,), math.log((1 - p) / (vocab - 2)))
        row[t] = math.log(p)
        row[M] = float("-inf")
        rows.append(row)
    return torch.stack(rows)[None]


def sparse(probs: dict[int, float], vocab: int = 10) -> torch.Tensor:
    """(V,) logits = log of a distribution given as {token: probability} (the rest 0)."""
    p = torch.zeros(vocab, dtype=torch.float64)
    for t, q in probs.items():
        p[t] = q
    return torch.log(p).float()


def selected(out) -> list[int]:
    out = out.select if isinstance(out, Selection) else out
    assert out.shape[0] == 1
    return out[0].nonzero().flatten().tolist()


# -- factor ------------------------------------------------------------------------------------


def test_factor_commits_the_longest_prefix_with_n_plus_1_times_error_below_f():
    tokens = torch.tensor([[1, M, M, M, M, M, M]])  # position 0 is prompt
    logits = conf((0.99, 1), (0.5, 1), (0.99, 2), (0.3, 3), (0.8, 4), (0.9, 5), (0.97, 6))
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1)
    # sorted masked confidences 0.99 (pos 2), 0.97, 0.9, 0.8, 0.5, 0.3
    # (n+1)(1-c_n): n=2: 3*0.03=0.09, n=3: 4*0.1=0.4, n=4: 5*0.2=1.0, n=5: 6*0.5=3.0
    rule = M2T.get("factor")
    assert selected(rule(factor=1.5)(ctx)) == [2, 4, 5, 6]
    assert selected(rule(factor=0.5)(ctx)) == [2, 5, 6]
    assert selected(rule(factor=0.2)(ctx)) == [2, 6]
    assert selected(rule(factor=0.01)(ctx)) == [2]  # at least one, the most confident
    assert selected(rule(factor=64.0)(ctx)) == [1, 2, 3, 4, 5, 6]


def test_factor_ignores_positions_outside_the_active_block():
    tokens = torch.tensor([[M, M, M, M]])
    logits = conf((0.99, 1), (0.6, 2), (0.95, 3), (0.99, 4))
    in_block = torch.tensor([[False, True, True, False]])
    ctx = make_context(tokens, logits, mask_token_id=M, in_block=in_block)
    assert selected(M2T.get("factor")(factor=1.0)(ctx)) == [2]  # n=2: 3*0.4 = 1.2 >= 1
    assert selected(M2T.get("factor")(factor=2.0)(ctx)) == [1, 2]


# -- margin / entropy --------------------------------------------------------------------------


def test_margin_ranks_by_top1_minus_top2_not_by_confidence():
    tokens = torch.full((1, 4), M)
    logits = dist([0.5, 0.45, 0.05], [0.45, 0.1, 0.1, 0.1, 0.1, 0.1, 0.05], [0.9, 0.05, 0.05], [0.6, 0.35, 0.05])
    ctx = make_context(tokens, logits, mask_token_id=M)
    # margins 0.05, 0.35, 0.85, 0.25; confidences 0.5, 0.45, 0.9, 0.6
    rule = M2T.get("margin")(steps_per_block=2)  # 4 masks over 2 steps: quota 2
    assert selected(rule(ctx)) == [1, 2]
    assert selected(M2T.get("topk")(steps_per_block=2)(ctx)) == [2, 3]  # confidence ranking differs
    # quota 1 (4 steps) plus every margin > 0.3
    assert selected(M2T.get("margin")(steps_per_block=4, threshold=0.3)(ctx)) == [1, 2]
    assert selected(M2T.get("margin")(steps_per_block=4, threshold=0.9)(ctx)) == [2]


def test_entropy_ranks_by_lowest_entropy():
    tokens = torch.tensor([[M, M, M, 3]])
    logits = dist([0.5, 0.5], [0.55, 0.15, 0.15, 0.15], [0.9, 0.1], [0.25, 0.25, 0.25, 0.25])
    ctx = make_context(tokens, logits, mask_token_id=M)
    h = entropy(ctx.probs)[0]
    assert h[0].item() == pytest.approx(math.log(2), abs=1e-5) and h[3].item() == pytest.approx(math.log(4), abs=1e-5)
    # entropies 0.693, 1.18, 0.325 on the masks; confidences 0.5, 0.55, 0.9
    assert selected(M2T.get("entropy")(steps_per_block=2)(ctx)) == [0, 2]  # 3 masks / 2 steps: quota 2
    assert selected(M2T.get("topk")(steps_per_block=2)(ctx)) == [1, 2]
    # quota 1 (3 steps), plus every entropy < 0.7 nats
    assert selected(M2T.get("entropy")(steps_per_block=3, threshold=0.7)(ctx)) == [0, 2]
    assert selected(M2T.get("entropy")(steps_per_block=3, threshold=0.6)(ctx)) == [2]


def test_quota_rules_follow_the_schedule_across_steps():
    tokens = torch.tensor([[M, M, 1, 2]])  # block began with 4 masks, 2 already committed
    logits = dist([0.5, 0.5], [0.9, 0.1], [1.0], [1.0])
    ctx = make_context(tokens, logits, mask_token_id=M, block_step=1, block_masked_start=torch.tensor([4]))
    # linear, 4 masks over 4 steps: 2 by the end of step 1, 2 already done: quota 1 (the minimum)
    assert selected(M2T.get("margin")(steps_per_block=4)(ctx)) == [1]
    # over 2 steps the block must be full after step 1: both remaining masks
    assert selected(M2T.get("entropy")(steps_per_block=2)(ctx)) == [0, 1]


# -- entropy bound -----------------------------------------------------------------------------


def test_entropy_bound_commits_largest_prefix_with_sum_minus_max_below_gamma():
    tokens = torch.tensor([[M, M, M, M, 5]])
    # entropies: 0 (one-hot), 0.693, 0.325, 1.386 (uniform over 4); position 4 is written
    logits = dist([1.0], [0.5, 0.5], [0.9, 0.1], [0.25] * 4, [0.5, 0.5])
    ctx = make_context(tokens, logits, mask_token_id=M)
    rule = M2T.get("entropy_bound")
    # ascending: pos0 (0), pos2 (0.325), pos1 (0.693), pos3 (1.386)
    # sum - max of the prefixes: 0, 0, 0.325, 1.018
    assert selected(rule(gamma=0.0)(ctx)) == [0, 2]
    assert selected(rule(gamma=0.3)(ctx)) == [0, 2]
    assert selected(rule(gamma=0.33)(ctx)) == [0, 1, 2]
    assert selected(rule(gamma=1.1)(ctx)) == [0, 1, 2, 3]
    assert selected(rule(gamma=0.33, proxy="confidence")(ctx)) == [0, 1, 2]


def test_entropy_bound_commits_at_least_one():
    tokens = torch.full((1, 3), M)
    ctx = make_context(tokens, dist([0.25] * 4, [0.3, 0.7], [0.25] * 4), mask_token_id=M)
    # ascending entropy: pos1 (0.611), then 1.386 twice: sum - max = 0.611 > 0 for the pair
    assert selected(M2T.get("entropy_bound")(gamma=0.0)(ctx)) == [1]


# -- hierarchy ---------------------------------------------------------------------------------


def test_hierarchy_commits_each_segments_best_above_low_plus_all_above_threshold():
    tokens = torch.tensor([[M, M, 4, M, M, M, M]])
    logits = conf((0.5, 1), (0.6, 1), (0.9, 4), (0.3, 2), (0.95, 3), (0.45, 5), (0.92, 6))
    ctx = make_context(tokens, logits, mask_token_id=M)
    rule = M2T.get("hierarchy")
    # segments {0, 1} and {3, 4, 5, 6}: bests 1 (0.6) and 4 (0.95); above 0.9: 4 and 6
    assert selected(rule(threshold=0.9, low_threshold=0.4)(ctx)) == [1, 4, 6]
    assert selected(rule(threshold=0.9, low_threshold=0.7)(ctx)) == [4, 6]
    assert selected(rule(threshold=0.99, low_threshold=0.0)(ctx)) == [1, 4]


def test_hierarchy_falls_back_to_the_single_best():
    tokens = torch.tensor([[M, 1, M, M]])
    ctx = make_context(tokens, conf((0.2, 1), (0.9, 1), (0.3, 2), (0.1, 3)), mask_token_id=M)
    assert selected(M2T.get("hierarchy")(threshold=0.9, low_threshold=0.4)(ctx)) == [2]


# -- klass (stateful) --------------------------------------------------------------------------


def step(rule, tokens, logits, memory, **kw):
    ctx = make_context(tokens, logits, mask_token_id=M, memory=memory, **kw)
    out = rule(ctx)
    assert isinstance(out, Selection)
    return selected(out), {**memory, rule.role: out.memory}


def test_klass_needs_a_confident_and_stable_distribution():
    rule = M2T.get("klass")(threshold=0.9, kl_threshold=0.01, history=1)
    a = conf((0.97, 1), (0.95, 2), (0.5, 3))
    # step 1: nothing has a previous distribution: fall back to the most confident mask
    got, memory = step(rule, torch.full((1, 3), M), a, {})
    assert got == [0]
    # step 2: position 1 unchanged (KL 0) and confident; position 2 became confident but moved
    b = conf((0.97, 1), (0.95, 2), (0.95, 4))
    got, memory = step(rule, torch.tensor([[1, M, M]]), b, memory)
    assert got == [1]
    # step 3: position 2 is now stable and confident
    got, _ = step(rule, torch.tensor([[1, 2, M]]), b, memory)
    assert got == [2]
    # the plain threshold rule would have committed both at step 2
    assert selected(M2T.get("threshold")(threshold=0.9)(make_context(torch.tensor([[1, M, M]]), b, mask_token_id=M))) == [1, 2]


def test_klass_history_counts_consecutive_small_kl_steps():
    a = conf((0.99, 1), (0.98, 2), (0.97, 3), (0.96, 4), (0.3, 5))  # the same every step: KL 0
    rule = M2T.get("klass")(threshold=0.9, kl_threshold=0.01, history=2)
    got, memory = step(rule, torch.full((1, 5), M), a, {})
    assert got == [0]  # nothing seen before: fallback
    got, memory = step(rule, torch.tensor([[1, M, M, M, M]]), a, memory)
    assert got == [1]  # one small-KL step is not enough for history 2: fallback again
    got, memory = step(rule, torch.tensor([[1, 2, M, M, M]]), a, memory)
    assert got == [2, 3]  # two small-KL steps and confident; position 4 is not confident
    got, _ = step(M2T.get("klass")(threshold=0.9, kl_threshold=0.01, history=1), torch.tensor([[1, M, M, M, M]]), a,
                  {"m2t": step(rule, torch.full((1, 5), M), a, {})[1]["m2t"]})
    assert got == [1, 2, 3]  # with history 1 they all go at the second step


def test_klass_memory_follows_rows_and_absolute_positions():
    rule = M2T.get("klass")(threshold=0.9, kl_threshold=0.01, history=1)
    a = conf((0.97, 1), (0.95, 2), (0.95, 3))
    # a batch of 3 rows; rows 0 and 1 forward first
    ctx = make_context(torch.full((2, 3), M), torch.cat([a, a]), mask_token_id=M, batch_rows=3)
    memory = {"m2t": rule(ctx).memory}
    row0 = memory["m2t"]["positions"][0].clone()
    # next step: only batch row 1 forwards, and its window moved one position right
    b = conf((0.95, 2), (0.95, 3), (0.95, 5))  # absolute positions 1, 2, 3
    ctx = make_context(torch.tensor([[M, M, M]]), b, mask_token_id=M, memory=memory, rows=torch.tensor([1]),
                       batch_rows=3)
    ctx.positions = torch.tensor([[1, 2, 3]])
    out = rule(ctx)
    assert selected(out) == [0, 1]  # absolute 1 and 2 are stable; 3 is new
    assert torch.equal(out.memory["positions"][0], row0)  # row 0's memory is kept for its next forward
    remembered = out.memory["positions"][1]
    assert remembered[remembered >= 0].tolist() == [3]
    # a row without memory starts over: nothing is stable, so only the fallback (the most confident) commits.
    # (Distinct confidences: equal ones tie up to rounding, which differs between CPUs' softmax kernels.)
    ctx = make_context(torch.tensor([[M, M, M]]), conf((0.96, 2), (0.95, 3), (0.94, 5)), mask_token_id=M,
                       memory=memory, rows=torch.tensor([2]), batch_rows=3)
    ctx.positions = torch.tensor([[1, 2, 3]])
    assert selected(rule(ctx)) == [0]


# -- credit (stateful) -------------------------------------------------------------------------


def boosted(p, credit, alpha):
    b = (1 + credit) ** alpha
    return p * b / (p * b + 1 - p)


def test_credit_accumulates_while_the_candidate_stays_and_resets_when_it_changes():
    rule = M2T.get("credit")(threshold=0.9, alpha=1.0, gamma=0.2, beta=0.8)
    c1 = 0.8**0.2
    c2 = 0.8 * c1 + 0.8**0.2
    assert boosted(0.8, c1, 1.0) < 0.9 < boosted(0.8, c2, 1.0)
    # step 1: position 0 is confident; 1 and 2 at 0.8 are not, even boosted once
    got, memory = step(rule, torch.full((1, 3), M), conf((0.95, 1), (0.8, 2), (0.8, 3)), {})
    assert got == [0]
    # step 2: position 1 keeps its candidate (credit grows past the threshold), 2 switches token
    got, memory = step(rule, torch.tensor([[1, M, M]]), conf((0.95, 1), (0.8, 2), (0.8, 4)), memory)
    assert got == [1]
    entry = memory["m2t"]
    kept = entry["positions"][0] >= 0
    assert entry["positions"][0][kept].tolist() == [2]
    assert entry["credit"][0][kept].item() == pytest.approx(c1, rel=1e-5)


def test_credit_falls_back_to_best_boosted_confidence():
    rule = M2T.get("credit")(threshold=0.99, alpha=1.0)
    got, _ = step(rule, torch.full((1, 2), M), conf((0.6, 1), (0.7, 2)), {})
    assert got == [1]


# -- ancestral ---------------------------------------------------------------------------------


def test_ancestral_commits_each_mask_with_probability_one_over_steps_left():
    tokens = torch.full((1, 40), M)
    logits = conf(*[(0.5, 1)] * 40)
    rule = M2T.get("ancestral")(steps_per_block=4)
    counts = [len(selected(rule(make_context(tokens, logits, mask_token_id=M, seed=s)))) for s in range(40)]
    assert 8 < sum(counts) / len(counts) < 12  # 40 masks * 1/4
    last = make_context(tokens, logits, mask_token_id=M, block_step=3)
    assert len(selected(rule(last))) == 40  # final step: everything
    one = M2T.get("ancestral")(steps_per_block=1)
    assert len(selected(one(make_context(tokens, logits, mask_token_id=M)))) == 40
    a = rule(make_context(tokens, logits, mask_token_id=M, seed=3))
    assert torch.equal(a, rule(make_context(tokens, logits, mask_token_id=M, seed=3)))


# -- t2t margin --------------------------------------------------------------------------------


def test_t2t_margin_edits_when_the_new_token_beats_the_current_one_by_delta():
    tokens = torch.tensor([[1, 2, 3, 4, M]])
    logits = torch.stack([
        sparse({7: 0.9, 1: 0.1}),  # prompt: never edited
        sparse({5: 0.6, 2: 0.3, 0: 0.05, 6: 0.05}),  # p(new) - p(current) = 0.3
        sparse({6: 0.5, 3: 0.45, 0: 0.05}),  # gain 0.05
        sparse({4: 0.9, 5: 0.1}),  # the model keeps the current token
        sparse({1: 1.0}),  # masked
    ])[None]
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1)
    assert ctx.sampled[0].tolist()[:4] == [7, 5, 6, 4]
    assert selected(T2T.get("margin")(delta=0.2)(ctx)) == [1]
    assert selected(T2T.get("margin")(delta=0.0)(ctx)) == [1, 2]
    assert selected(T2T.get("margin")(delta=0.5)(ctx)) == []


# -- remask: WINO low confidence ---------------------------------------------------------------


def remask_ctx(commit: list[int], **kw):
    # pos0 prompt; pos1..3 written with p(own token) 0.2, 0.5, 0.95; pos4..7 masked
    tokens = torch.tensor([[1, 2, 3, 4, M, M, M, M]])
    logits = conf((0.9, 1), (0.2, 2), (0.5, 3), (0.95, 4), (0.9, 1), (0.9, 1), (0.9, 1), (0.9, 1))
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1, **kw)
    ctx.commit = torch.zeros_like(ctx.masked)
    ctx.commit[0, commit] = True
    ctx.edit = torch.zeros_like(ctx.masked)
    return ctx


def test_low_confidence_remask_lowest_first_within_commits_minus_one():
    rule = REMASK.get("low_confidence")(threshold=0.9)
    assert selected(rule(remask_ctx([4]))) == []  # one commit: no budget
    assert selected(rule(remask_ctx([4, 5]))) == [1]
    assert selected(rule(remask_ctx([4, 5, 6, 7]))) == [1, 2]  # 0.95 stays
    assert selected(REMASK.get("low_confidence")(threshold=0.3)(remask_ctx([4, 5, 6, 7]))) == [1]


def test_low_confidence_remask_stays_in_the_active_block_and_skips_edits():
    in_block = torch.tensor([[False, False, True, True, True, True, True, True]])
    region = torch.ones(1, 8, dtype=torch.bool)  # edit window reaches the previous block
    ctx = remask_ctx([4, 5, 6], in_block=in_block, editable_region=region)
    assert ctx.editable[0, 1]
    assert selected(REMASK.get("low_confidence")(threshold=0.9)(ctx)) == [2]
    ctx.edit[0, 2] = True
    assert selected(REMASK.get("low_confidence")(threshold=0.9)(ctx)) == []  # pos 3 is confident


# -- remask: ReMDM -----------------------------------------------------------------------------


def remdm_ctx(n_commit: int, seed: int, written_conf=None):
    # 8 written, 16 masked in a block that began with 24 masks
    tokens = torch.tensor([[1] * 8 + [M] * 16])
    logits = conf(*[(0.6, 1)] * 24)
    ctx = make_context(tokens, logits, mask_token_id=M, block_masked_start=torch.tensor([24]), seed=seed)
    ctx.commit = torch.zeros_like(ctx.masked)
    ctx.commit[0, 8 : 8 + n_commit] = True
    ctx.edit = torch.zeros_like(ctx.masked)
    if written_conf is not None:
        ctx.written_conf = written_conf
    return ctx


def test_remdm_rates_follow_the_schedules():
    # alpha_t = 8/24, alpha_s = 20/24: sigma_max = min(1, (4/24) / (8/24)) = 0.5
    rescale = REMASK.get("remdm")(schedule="rescale", eta=1.0)
    cap = REMASK.get("remdm")(schedule="cap", eta=0.1)
    n = 60
    mean_rescale = sum(len(selected(rescale(remdm_ctx(12, s)))) for s in range(n)) / n
    mean_cap = sum(len(selected(cap(remdm_ctx(12, s)))) for s in range(n)) / n
    assert 3.0 < mean_rescale < 5.0  # 8 candidates * 0.5
    assert 0.3 < mean_cap < 1.5  # 8 * 0.1
    assert all(len(selected(rescale(remdm_ctx(16, s)))) == 0 for s in range(5))  # nothing left masked: sigma 0
    assert len(selected(REMASK.get("remdm")(schedule="cap", eta=0.0)(remdm_ctx(12, 0)))) == 0
    # capped at commits - 1
    assert all(len(selected(REMASK.get("remdm")(schedule="rescale", eta=1.0)(remdm_ctx(2, s)))) <= 1 for s in range(10))


def test_remdm_conf_schedule_prefers_tokens_written_with_low_confidence():
    psi = torch.tensor([[0.0] + [8.0] * 7 + [0.0] * 16])
    rule = REMASK.get("remdm")(schedule="conf")
    hits = [0] * 8
    for s in range(60):
        for p in selected(rule(remdm_ctx(12, s, written_conf=psi))):
            hits[p] += 1
    assert hits[0] >= 15 and sum(hits[1:]) <= 3  # sigma_0 ~ 0.5, the others ~ 0.5 * e^-8


def test_remdm_is_seeded():
    rule = REMASK.get("remdm")(schedule="rescale", eta=1.0)
    assert torch.equal(rule(remdm_ctx(12, 4)), rule(remdm_ctx(12, 4)))
    assert any(not torch.equal(rule(remdm_ctx(12, 4)), rule(remdm_ctx(12, s))) for s in range(5, 10))
