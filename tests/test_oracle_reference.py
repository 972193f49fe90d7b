"""The reference rule (strategies/m2t_reference.py) and the oracle's joint: the prefix consistency
probabilities against an independent enumeration, the rule's choice (the longest prefix whose risk is
<= eps, and not one more), its closed form on shuffle, and the one-line refusal of other models."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.evaluation.evaluate import evaluate
from dlm_toolkit.models.oracle import load_oracle
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.tasks import get_task
from test_oracle import brute_answers, brute_marginal


def brute_prefix(answers: list[str], canvas: list[str | None], order: list[int]) -> list[float]:
    """P(the first k positions of order, drawn independently from their marginals, fit a valid
    answer agreeing with the written tokens), by enumerating every assignment."""
    fit = [a for a in answers if all(c is None or a[j] == c for j, c in enumerate(canvas))]
    margs = [brute_marginal(answers, canvas, i) for i in order]
    out = []
    for k in range(1, len(order) + 1):
        total = 0.0
        for combo in itertools.product(*[list(m.items()) for m in margs[:k]]):
            if any(all(a[order[t]] == combo[t][0] for t in range(k)) for a in fit):
                total += math.prod(p for _, p in combo)
        out.append(total)
    return out


@pytest.mark.parametrize("kind, items, extra, exclude", [
    ("list_shuffle", "dbca", "", False), ("list_shuffle", "dbca", "", True), ("list_replace", "bcda", "e", False),
    ("list_insert", "cab", "d", False), ("latin_square", "cab", "", False)])
def test_joint_consistency_equals_the_enumeration(kind, items, extra, exclude):
    model, tok = load_oracle(f"oracle:{kind}")
    answers = brute_answers(kind, items, extra, exclude)
    prompt = f"{kind}{'_new' if exclude else ''}:{items}{',' + extra if extra else ''}="
    P, A = len(prompt), len(answers[0])
    rng = random.Random(kind + str(exclude))
    canvases, orders = [], []
    for _ in range(25):
        base = rng.choice(answers)  # consistent canvases: written tokens from one valid answer
        cv = [base[j] if rng.random() < 0.4 else None for j in range(A)]
        masked = [j for j in range(A) if cv[j] is None] or [0]
        cv[masked[0]] = None
        rng.shuffle(masked)
        canvases.append(cv)
        orders.append(masked[:4])
    ids = torch.tensor([tok.encode(prompt) + [model.mask_token_id if c is None else tok.convert_tokens_to_ids(c)
                                              for c in cv] + [model.mask_token_id] * 3 for cv in canvases])
    got = model.joint_consistency(ids, [[P + A + 1] + [P + j for j in o] for o in orders])
    for cv, o, g in zip(canvases, orders, got):
        want = brute_prefix(answers, cv, o)
        assert g[0] == 1.0  # an EOS position first: it never breaks consistency
        assert g[1:].tolist() == pytest.approx(want, abs=1e-9), (cv, o)


def reference(eps: float, block: int) -> dict:
    return {"m2t": {"name": "reference", "params": {"eps": eps}}, "t2t": {"name": "none"}, "remask": {"name": "none"},
            "blocks": {"name": "semi_ar", "params": {"block_length": block, "max_post_steps": 0, "align": "prompt"}},
            "sampling": {"temperature": 1.0}}


def test_reference_rule_commits_the_longest_prefix_within_eps():
    """Shuffle n = 6 from the empty canvas: P(first k distinct) = 1, 5/6, 5/9, 5/18: eps = 0.2 commits
    two, eps = 1/6 exactly also two (>= is inclusive), eps just below 1/6 one, eps = 0.45 three."""
    model, tok = load_oracle("oracle:list_shuffle")
    task = get_task("list_shuffle", n_items=6)
    from dlm_toolkit.decoding.loop import decode

    prompts = [tok.encode(i.prompt) for i in task.instances(40, 0, "eval")]
    for eps, first in [(0.2, 2), (1 / 6, 2), (1 / 6 - 1e-4, 1), (0.45, 3), (0.0, 1), (1.0, 6)]:
        out = decode(model, prompts, DecodingPolicy(reference(eps, 6)), 7, seed=0, record=True)
        firsts = {len(s.commit) for s in out.trajectory.steps if s.step == 0}
        assert firsts == {first}, (eps, firsts)
    # the ranking is by confidence, most confident first: with the EOS slot in the block (confidence 1, it
    # never breaks consistency) eps = 0.2 commits the EOS and two items; ranked the other way round, two
    out = decode(model, prompts, DecodingPolicy(reference(0.2, 7)), 7, seed=0, record=True)
    assert {len(s.commit) for s in out.trajectory.steps if s.step == 0} == {3}


@pytest.mark.parametrize("eps, p, n", [(0.0, 1.0, 150), (0.2, 5 / 6, 700)])
def test_reference_rule_accuracy_has_its_closed_form(eps, p, n):
    """eps = 0: never a risk, accuracy 1.0 at n forwards; eps = 0.2: only the first step (two of six,
    5/6) takes a risk, every later step commits one: accuracy 5/6 (near miss: 2/3 is outside)."""
    model, tok = load_oracle("oracle:list_shuffle")
    res = evaluate(model, tok, get_task("list_shuffle", n_items=6), reference(eps, 6), n, batch_size=n,
                   progress=False).metrics
    half = 2.576 * math.sqrt(max(p * (1 - p), 1e-12) / n)
    assert abs(res["accuracy"] - p) <= half, res
    if eps == 0.0:
        assert res["nfe_mean"] == 6 + 1  # one item per forward, then the EOS block in one
    else:
        assert abs(res["accuracy"] - 2 / 3) > half


def test_other_models_are_refused_in_one_line():
    from dlm_toolkit.decoding.loop import decode
    from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits

    model = ScriptedLM(mixing_logits(24), 24, 23, 22)
    with pytest.raises(ConfigError, match=r"m2t rule 'reference' needs a model that exposes its joint distribution "
                                          r"\(an oracle: --checkpoint oracle:TASK\); ScriptedLM does not"):
        decode(model, [[1, 2]], DecodingPolicy(reference(0.1, 4)), 4, seed=0)
