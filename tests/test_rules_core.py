"""Built-in core rules on hand-built logits."""

import math

import torch

from dlm_toolkit.strategy.registry import M2T, T2T
from dlm_toolkit.testing import make_context
from strategies.schedules import cosine, linear, quota

M = 9  # mask id in a 10-token vocab


def logits_for(conf_token: list[tuple[float, int]], vocab: int = 10) -> torch.Tensor:
    """(1, W, V) logits whose softmax gives token t probability p (rest spread evenly)."""
    rows = []
    for p, t in conf_token:
        rest = (1 - p) / (vocab - 1)
        row = torch.full((vocab,), math.log(rest))
        row[t] = math.log(p)
        rows.append(row)
    return torch.stack(rows)[None]


def test_threshold_commits_strictly_above_and_only_masked():
    tokens = torch.tensor([[1, M, M, M, 2]])
    logits = logits_for([(0.95, 1), (0.9, 3), (0.7, 4), (0.6, 5), (0.99, 6)])
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1)
    commit = M2T.get("threshold")(threshold=0.7)(ctx)
    assert commit.tolist() == [[False, True, False, False, False]]  # 0.7 is not > 0.7; pos 4 is written


def test_threshold_fallback_commits_single_most_confident_mask():
    tokens = torch.tensor([[M, M, M], [1, 2, 3]])
    logits = torch.cat([logits_for([(0.3, 1), (0.5, 2), (0.4, 3)]), logits_for([(0.2, 1)] * 3)])
    ctx = make_context(tokens, logits, mask_token_id=M)
    commit = M2T.get("threshold")(threshold=0.9)(ctx)
    assert commit.tolist() == [[False, True, False], [False, False, False]]  # row 1 has no mask


def test_threshold_ignores_masks_outside_active_block():
    tokens = torch.tensor([[M, M, M, M]])
    logits = logits_for([(0.99, 1), (0.2, 2), (0.3, 3), (0.99, 4)])
    in_block = torch.tensor([[False, True, True, False]])
    ctx = make_context(tokens, logits, mask_token_id=M, in_block=in_block)
    assert M2T.get("threshold")(threshold=0.5)(ctx).tolist() == [[False, False, True, False]]


def test_t2t_threshold_edits_changed_confident_written_non_prompt():
    tokens = torch.tensor([[1, 2, 3, 4, M]])
    # pos0 prompt (would change), pos1 same token, pos2 changes at 0.8, pos3 changes at 0.4, pos4 masked
    logits = logits_for([(0.99, 5), (0.99, 2), (0.8, 7), (0.4, 8), (0.99, 1)])
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1)
    assert T2T.get("threshold")(threshold=0.5)(ctx).tolist() == [[False, False, True, False, False]]
    assert T2T.get("threshold")(threshold=0.0)(ctx).tolist() == [[False, False, True, True, False]]
    assert not T2T.get("none")()(ctx).any()


def test_topk_low_confidence_follows_linear_quota():
    tokens = torch.full((1, 8), M)
    confs = [0.1, 0.8, 0.3, 0.9, 0.5, 0.2, 0.7, 0.6]
    logits = logits_for([(c, 1) for c in confs])
    rule = M2T.get("topk")(steps_per_block=4)
    ctx = make_context(tokens, logits, mask_token_id=M, block_step=0)
    assert ctx.fillable.sum() == 8
    commit = rule(ctx)
    assert commit[0].nonzero().flatten().tolist() == [1, 3]  # the two most confident


def test_topk_random_ranking_is_seeded():
    tokens = torch.full((1, 16), M)
    logits = logits_for([(0.5, 1)] * 16)
    rule = M2T.get("topk")(steps_per_block=4, ranking="random")
    a = rule(make_context(tokens, logits, mask_token_id=M, seed=1))
    b = rule(make_context(tokens, logits, mask_token_id=M, seed=1))
    c = rule(make_context(tokens, logits, mask_token_id=M, seed=2))
    assert a.sum() == 4 and torch.equal(a, b) and not torch.equal(a, c)


def test_schedules_sum_to_masks_and_are_monotone():
    for masks in range(0, 40):
        for steps in (1, 3, 8, 32):
            m = torch.tensor([masks])
            for fn in (linear, cosine):
                cum = [int(fn(m, steps, torch.tensor([s]))) for s in range(steps)]
                assert cum[-1] == masks and cum == sorted(cum), (fn.__name__, masks, steps, cum)
    # LLaDA: 10 masks over 4 steps -> 3, 3, 2, 2
    m = torch.tensor([10])
    assert [int(linear(m, 4, torch.tensor([s]))) for s in range(4)] == [3, 6, 8, 10]
    # cosine commits fewer early than linear
    assert int(cosine(torch.tensor([32]), 8, torch.tensor([0]))) < int(linear(torch.tensor([32]), 8, torch.tensor([0])))


def test_quota_catches_up_and_never_exceeds_masked():
    q = quota("linear", torch.tensor([8, 8, 8]), torch.tensor([8, 2, 8]), 4, torch.tensor([0, 1, 3]))
    assert q.tolist() == [2, 1, 8]
