"""The per-step fast paths (issue 36, engine overhead) against plain reference implementations.

Each fast path replaces a longer chain of small tensor ops with fewer ones that must give exactly the
same values: greedy sampling as one max without the mask column, ``top1`` by argmax, the
``threshold`` M2T rule, the mask count and block bounds of every row without gathers by row, the
context's snapshot of the per-row counters, and ``advance_blocks``. The references are Python loops
over plain lists (or the general path the fast one skips), never the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from dlm_toolkit import DecodingPolicy
from dlm_toolkit.config import SamplingConfig
from dlm_toolkit.decoding.loop import step_context
from dlm_toolkit.step.sampling import sample
from dlm_toolkit.strategy.selection import top1, top1_of_masked, topk_per_row
from dlm_toolkit.step.state import DecodeState
from dlm_toolkit.testing import make_context
from strategies.blocks_semi_ar import SemiAutoregressive
from strategies.m2t_threshold import ThresholdUnmask


def no_rand(*_args, **_kwargs):
    raise AssertionError("greedy sampling draws nothing")


def first_max(values: list[float], skip: int | None = None) -> int:
    """Index of the first maximal value (NaN counts as the largest), leaving out ``skip``."""
    best = None
    for i, v in enumerate(values):
        if i == skip:
            continue
        if best is None:
            best = i
        elif math.isnan(values[best]):
            continue
        elif math.isnan(v) or v > values[best]:
            best = i
    assert best is not None
    return best


def greedy_reference(probs: torch.Tensor, mask: int) -> tuple[list[list[int]], list[list[float]]]:
    """The documented rule: the argmax (first maximal index); where that is the mask token, the
    best other token (first maximal among the others)."""
    tokens, confs = [], []
    for row in probs.tolist():
        t_row, c_row = [], []
        for p in row:
            best = first_max(p)
            if 0 <= mask < len(p) and best == mask:
                best = first_max(p, skip=mask)
            t_row.append(best)
            c_row.append(p[best])
        tokens.append(t_row)
        confs.append(c_row)
    return tokens, confs


def crafted_logits(v: int, mask: int) -> torch.Tensor:
    """(2, 6, v) logits with the cases a fast greedy path can get wrong."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, v, generator=g)
    logits[0, 0, mask] = 9.0  # the mask token is the argmax: the runner-up is written
    logits[0, 1, mask] = 9.0  # ... tied with an earlier and a later token: the earlier one wins
    logits[0, 1, 1] = 9.0
    logits[0, 1, v - 2] = 9.0
    logits[0, 2, 3] = 5.0  # a near miss: the mask token a hair below the best token
    logits[0, 2, mask] = 5.0 - 1e-3
    logits[0, 3, mask] = 5.0  # ... and a hair above it
    logits[0, 3, 3] = 5.0 - 1e-3
    logits[0, 4, 2] = logits[0, 4, 4] = 7.0  # a tie between two other tokens: the first one
    logits[1, 0, v - 2] = 8.0  # the best other token right next to a last-column mask
    logits[1, 0, mask] = 8.5
    logits[1, 1] = float("-inf")  # every other token at probability exactly 0: still one of them, never the mask
    logits[1, 1, mask] = 1.0
    return logits


@pytest.mark.parametrize("v,mask", [(12, 5), (12, 11), (12, 0), (12, -1), (12, 12)])
def test_greedy_sample_matches_reference_and_leaves_probs_intact(v, mask):
    logits = crafted_logits(v, max(0, min(mask, v - 1)))
    sampled, confidence, probs = sample(logits, SamplingConfig(temperature=0.0), mask, no_rand)
    assert torch.equal(probs, torch.softmax(logits, dim=-1)), "probs must come back unchanged"
    tokens, confs = greedy_reference(probs, mask)
    assert sampled.tolist() == tokens
    assert confidence.tolist() == confs
    if 0 <= mask < v:
        assert not (sampled == mask).any()
        assert sampled[0, 0] != mask and sampled[0, 1] == (1 if mask != 1 else v - 2)


def test_greedy_sample_with_nan_logits_is_the_general_rule():
    logits = crafted_logits(10, 4)
    logits[1, 2, 6] = float("nan")
    logits[1, 3, 4] = float("nan")  # NaN at the mask column only
    sampled, confidence, probs = sample(logits, SamplingConfig(temperature=0.0), 4, no_rand)
    tokens, _ = greedy_reference(probs, 4)
    assert sampled.tolist() == tokens


def random_scores(seed: int, b: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    score = torch.randint(0, 3, (b, w), generator=g).float()  # many ties
    r = torch.rand(b, w, generator=g)
    score[r < 0.1] = float("nan")
    score[(r >= 0.1) & (r < 0.2)] = float("-inf")
    allowed = torch.rand(b, w, generator=g) < 0.5
    allowed[0] = False  # a row with nothing allowed
    return score, allowed


def top1_reference(score: torch.Tensor, allowed: torch.Tensor) -> list[list[bool]]:
    """A stable descending sort of the row with disallowed positions at -inf; its first entry is
    picked if it is allowed."""
    out = []
    for s, a in zip(score.tolist(), allowed.tolist()):
        masked = [v if ok else -math.inf for v, ok in zip(s, a)]
        best = first_max(masked)
        out.append([i == best and a[i] for i in range(len(s))])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_top1_matches_reference_and_the_general_topk(seed):
    score, allowed = random_scores(seed, 5, 3 + 5 * seed)
    got = top1(score, allowed)
    assert got.tolist() == top1_reference(score, allowed)
    assert torch.equal(got, topk_per_row(score, allowed, torch.ones(5, dtype=torch.long)))
    assert not got[0].any(), "a row with nothing allowed selects nothing"
    # the form taking the score already at -inf outside allowed (the threshold rule's)
    assert torch.equal(top1_of_masked(torch.where(allowed, score, float("-inf")), allowed), got)


def test_threshold_unmask_matches_reference():
    # rows: several above the threshold; none above (the best one, first of a tie); one exactly at the
    # threshold (strict: not above); nothing fillable; the best fillable position is below a better
    # unfillable one
    conf = torch.tensor([
        [0.95, 0.2, 0.71, 0.69],
        [0.3, 0.6, 0.6, 0.1],
        [0.7, 0.5, 0.7, 0.1],
        [0.9, 0.9, 0.9, 0.9],
        [0.99, 0.4, 0.5, 0.3],
        [0.8, float("nan"), 0.1, 0.1],
    ])
    fillable = torch.tensor([
        [True, True, True, True],
        [True, True, True, False],
        [True, True, True, False],
        [False, False, False, False],
        [False, True, True, True],
        [True, True, True, False],
    ])
    mask = 9
    tokens = torch.where(fillable, mask, 1)
    logits = torch.full((6, 4, 10), -30.0)
    ctx = make_context(tokens, logits, mask_token_id=mask)
    ctx.confidence = conf  # the rule reads only fillable and confidence
    got = ThresholdUnmask(threshold=0.7)(ctx)
    expected = [
        [True, False, True, False],
        [False, True, False, False],
        [True, False, False, False],
        [False, False, False, False],
        [False, False, True, False],
        [True, False, False, False],  # a NaN confidence: never above the threshold, and no top-1 is added
    ]
    assert got.tolist() == expected


def fixed_state(prompts: list[list[int]], gen: int = 20, block: int = 8) -> DecodeState:
    schedule = SemiAutoregressive(block_length=block, eos_early_stop=True)
    return DecodeState.start(prompts, gen, schedule, mask_token_id=99, eos_token_id=98, vocab_size=100, seed=0)


def test_all_rows_is_one_tensor_per_decode():
    state = fixed_state([[1, 2, 3], [4] * 11])
    assert state.all_rows is state.all_rows
    assert state.all_rows.tolist() == [0, 1]
    assert state.offsets(5).tolist() == [0, 1, 2, 3, 4] and state.offsets(5) is state.offsets(5)


def test_block_bounds_and_mask_count_without_gathers_match_the_row_paths():
    # prompts of 3 and 11 tokens, blocks of 8 aligned at 0: active blocks 0 and 1
    state = fixed_state([[1, 2, 3], [4] * 11])
    state.canvas[0, 5] = 7  # one generated position of row 0's block written
    rows = torch.arange(2)  # the same rows, but not the decode's own tensor: the indexing path
    assert rows is not state.all_rows
    for which in (state.all_rows, rows):
        lo, hi = state.block_bounds(which)
        assert lo.tolist() == [0, 8] and hi.tolist() == [8, 16]
        assert state.masked_in_block(which).tolist() == [4, 5]  # hand count: 8-3-1 and 16-11
    lo, hi = state.block_bounds(state.all_rows, torch.tensor([2, 2]))
    assert lo.tolist() == [16, 16] and hi.tolist() == [24, 24]
    assert state.masked_in_block(torch.tensor([1])).tolist() == [5]
    # past the last block (a finished row): the count reads the canvas's last column, never past it
    state.block[:] = torch.tensor([3, 4])
    assert state.masked_in_block(state.all_rows).tolist() == [8, 8]


def test_block_bounds_with_blocks_aligned_after_the_prompt():
    schedule = SemiAutoregressive(block_length=8, align="prompt")
    state = DecodeState.start([[1, 2, 3], [4] * 11], 20, schedule, 99, 98, 100, 0)
    state.block[:] = torch.tensor([1, 2])
    for which in (state.all_rows, torch.arange(2)):
        lo, hi = state.block_bounds(which)
        assert lo.tolist() == [11, 27] and hi.tolist() == [19, 35]
    state.canvas[1, 30] = 5
    assert state.masked_in_block(state.all_rows).tolist() == [8, 7]


def test_advance_blocks_hand_worked():
    # row 0: prompt 3, blocks [0,8) [8,16) [16,24) (3 blocks); row 1: prompt 11, blocks 1..3 of 4
    state = fixed_state([[1, 2, 3], [4] * 11])
    state.post[:] = torch.tensor([3, 4])
    state.block_step[:] = torch.tensor([5, 6])
    state.canvas[0, 8:11] = 7  # row 0's next block has 3 written positions
    state.advance_blocks(torch.tensor([True, False]), eos_early_stop=False)
    assert state.block.tolist() == [1, 1]
    assert state.post.tolist() == [0, 4] and state.block_step.tolist() == [0, 6]
    assert state.block_masked.tolist() == [5, 5] and state.block_masked_start.tolist() == [5, 5]
    assert state.done.tolist() == [False, False]
    # row 1 ends its last block: done, its post/step counters and block count untouched
    state.block[1] = 3
    state.post[1] = 2
    state.advance_blocks(torch.tensor([False, True]), eos_early_stop=False)
    assert state.done.tolist() == [False, True] and state.block.tolist() == [1, 4]
    assert state.post.tolist() == [0, 2]
    # an EOS with no mask left in the generated part stops row 0 early; a mask left there does not
    state.canvas[0, 3:16] = 7
    state.canvas[0, 9] = 98
    state.canvas[0, 15] = 99  # near miss first: one mask left
    state.advance_blocks(torch.tensor([True, False]), eos_early_stop=True)
    assert state.eos_stopped.tolist() == [False, False] and state.block.tolist() == [2, 4]
    state.block[0] = 1
    state.canvas[0, 15] = 7
    state.advance_blocks(torch.tensor([True, False]), eos_early_stop=True)
    assert state.eos_stopped.tolist() == [True, False] and state.done.tolist() == [True, True]
    assert state.block.tolist() == [1, 4], "a stopped row keeps its block"


def test_context_counters_are_snapshots():
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 8})
    state = DecodeState.start([[1, 2, 3], [4] * 11], 20, policy.blocks, 99, 98, 100, 0)
    state.counts[:, 0] = torch.tensor([3, 4])
    state.block_step[:] = torch.tensor([1, 2])
    live = ~state.done
    lo, hi = policy.blocks.window(state, state.all_rows)
    ctx = step_context(policy, state, live, lo, hi, torch.zeros(2, 8, 100))
    # the loop updates these in place after the rules ran: the context must keep the step's values
    state.counts[:, 0] += 1
    state.block += 1
    state.block_step += 1
    state.block_masked_start += 1
    assert ctx.step.tolist() == [3, 4] and ctx.block.tolist() == [0, 1]
    assert ctx.block_step.tolist() == [1, 2] and ctx.block_masked_start.tolist() == [5, 5]
    # the derived masks, by hand: row 0's window [0, 8) holds prompt 0..2, row 1's [8, 16) prompt 8..10
    assert ctx.fillable.tolist() == [[False] * 3 + [True] * 5] * 2
    assert ctx.editable.sum().item() == 0 and ctx.post.tolist() == [False, False]


def test_finish_step_on_a_subset_of_rows_matches_every_row():
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 8, "blocks.params.eos_early_stop": False})
    results = []
    for subset in (False, True):
        state = DecodeState.start([[1, 2, 3], [4] * 11, [5] * 2], 20, policy.blocks, 99, 98, 100, 0)
        live = ~state.done
        lo, hi = policy.blocks.window(state, state.all_rows)
        ctx = step_context(policy, state, live, lo, hi, torch.zeros(3, 8, 100))
        ctx.post = torch.tensor([True, False, True])
        ctx.edit = torch.zeros(3, 8, dtype=torch.bool)
        ctx.edit[2, 7] = True  # a post step with an edit does not end its block
        if subset:  # the same step seen as a context of rows 2 and 0 (e.g. a hand-made one)
            order = torch.tensor([2, 0])
            ctx.rows, ctx.post, ctx.edit = order, ctx.post[order], ctx.edit[order]
        policy.blocks.finish_step(state, ctx)
        results.append(state.block.tolist())
    assert results == [[1, 1, 0], [1, 1, 0]]


def test_context_post_only_in_live_rows_without_masks():
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 8})
    state = DecodeState.start([[1, 2, 3], [4] * 11, [5] * 3], 20, policy.blocks, 99, 98, 100, 0)
    state.canvas[0, 3:8] = 7  # rows 0 and 1: active block fully written; row 2: masks left
    state.canvas[1, 11:16] = 7
    state.canvas[2, 3:7] = 7
    live = torch.tensor([True, False, True])
    lo, hi = policy.blocks.window(state, state.all_rows)
    ctx = step_context(policy, state, live, lo, hi, torch.zeros(3, 8, 100))
    assert ctx.post.tolist() == [True, False, False]
