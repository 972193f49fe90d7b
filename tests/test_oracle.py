"""The oracle models and list tasks (issue 44): exact marginals against an independent brute force,
the closed forms of parallel decoding reproduced by evaluations, and the one-line refusals.

The brute-force reference here enumerates every string over the instance's symbols, keeps the valid
ones by a validity check written again here (not the task's verifier), and conditions on the visible
tokens by the documented rule (minimum Hamming distance over the conditioning positions)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
from dlm_toolkit.models.oracle import OracleLM, latin_squares, load_oracle, parse_prompt
from dlm_toolkit.tasks import get_task

FOREIGN = "Z"  # a character no instance below uses


def brute_valid(kind: str, items: str, extra: str, exclude: bool, s: str) -> bool:
    n = len(items)
    if kind == "list_copy":
        return s == items
    if kind == "list_reverse":
        return s == "".join(reversed(items))
    if kind == "list_sort":
        return list(s) == sorted(items, key=lambda c: (c.isdigit(), c.isupper(), c))
    if kind == "list_shuffle":
        return sorted(s) == sorted(items) and not (exclude and s == items)
    if kind == "list_replace":
        diff = [k for k in range(n) if s[k] != items[k]]
        return len(s) == n and len(diff) == 1 and s[diff[0]] == extra
    if kind == "list_insert":
        return any(s[k] == extra and s[:k] + s[k + 1:] == items for k in range(n + 1))
    if kind == "latin_square":
        rows = [s[r * n:(r + 1) * n] for r in range(n)]
        return all(set(r) == set(items) for r in rows) and all(set(c) == set(items) for c in zip(*rows))
    raise AssertionError(kind)


def brute_answers(kind: str, items: str, extra: str = "", exclude: bool = False) -> list[str]:
    length = len(items) ** 2 if kind == "latin_square" else len(items) + (kind == "list_insert")
    symbols = items + extra
    return ["".join(s) for s in itertools.product(symbols, repeat=length)
            if brute_valid(kind, items, extra, exclude, "".join(s))]


def brute_marginal(answers: list[str], canvas: list[str | None], i: int) -> dict[str, float]:
    """Position i's marginal given every other written position, minimum-Hamming rule."""
    cond = [j for j, c in enumerate(canvas) if c is not None and j != i]
    dist = [sum(a[j] != canvas[j] for j in cond) for a in answers]
    best = min(dist)
    near = [a for a, d in zip(answers, dist) if d == best]
    out: dict[str, float] = {}
    for a in near:
        out[a[i]] = out.get(a[i], 0.0) + 1.0 / len(near)
    return out


@pytest.fixture(scope="module")
def tok():
    from dlm_toolkit.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def oracle_probs(model: OracleLM, tok, prompt: str, canvases: list[list[str | None]], attn=None) -> torch.Tensor:
    """(R, A, V) float64 softmax of the oracle's logits at the answer positions of each canvas."""
    p = tok.encode(prompt)
    rows = [p + [model.mask_token_id if c is None else tok.convert_tokens_to_ids(c) for c in cv]
            + [model.mask_token_id] * 2 for cv in canvases]
    ids = torch.tensor(rows)
    B, T = ids.shape
    pos = torch.arange(T).expand(B, T)
    mask = torch.ones(B, T, T, dtype=torch.bool) if attn is None else attn
    logits = model.forward_window(ids, pos, mask)
    assert logits.dtype == torch.float32 and logits.shape == (B, T, model.vocab_size)
    A = len(canvases[0])
    eos = logits[:, len(p) + A:].argmax(-1)
    assert (eos == model.eos_token_id).all()  # past the answer: EOS
    return torch.softmax(logits[:, len(p):len(p) + A].double(), -1)


CASES = [  # kind, items, extra, exclude, random canvases
    ("list_shuffle", "adbc", "", False, 160),
    ("list_shuffle", "adbc", "", True, 160),
    ("list_shuffle", "abc", "", True, 80),
    ("list_replace", "bcda", "e", False, 120),
    ("list_insert", "cab", "d", False, 120),
    ("list_copy", "bdac", "", False, 40),
    ("list_reverse", "bdac", "", False, 40),
    ("list_sort", "bDa1", "", False, 40),
    ("latin_square", "cab", "", False, 120),
]


@pytest.mark.parametrize("kind, items, extra, exclude, count", CASES)
def test_marginals_equal_the_brute_force_on_random_canvases(tok, kind, items, extra, exclude, count):
    """Masked and written positions (leave-one-out), consistent and inconsistent canvases, foreign
    tokens: every answer position's distribution equals the brute-force conditional."""
    model = OracleLM(kind, tok)
    answers = brute_answers(kind, items, extra, exclude)
    rng = random.Random(f"{kind}{exclude}")
    symbols = items + extra + FOREIGN
    canvases = []
    for r in range(count):
        base = rng.choice(answers)
        keep = rng.random()
        cv = [None if rng.random() < 0.5 else (base[j] if rng.random() < keep else rng.choice(symbols))
              for j in range(len(base))]
        canvases.append(cv)
    canvases.append([None] * len(answers[0]))
    canvases.append(list(answers[0]))  # fully written, valid: leave-one-out returns each own token
    prompt = f"{kind}{'_new' if exclude else ''}:{items}{',' + extra if extra else ''}="
    probs = oracle_probs(model, tok, prompt, canvases)
    for r, cv in enumerate(canvases):
        for i in range(len(cv)):
            want = brute_marginal(answers, cv, i)
            got = {tok.convert_ids_to_tokens(v): float(probs[r, i, v]) for v in range(model.vocab_size)
                   if probs[r, i, v] > 1e-9}
            assert got.keys() == want.keys(), (cv, i, got, want)
            for c, p in want.items():
                assert got[c] == pytest.approx(p, abs=2e-6), (cv, i, c, got, want)


def test_a_block_the_query_cannot_see_is_not_conditioned_on(tok):
    """Block-causal: position 0 does not see a written position 2 in a later block, so its
    marginal is uniform; with full visibility it excludes the written item (near miss)."""
    model = OracleLM("list_shuffle", tok)
    prompt = "list_shuffle:abc="
    P = len(prompt)
    T = P + 3 + 2
    blocks = torch.tensor([0] * (P + 2) + [1] * 3)
    causal = (blocks[None, :] <= blocks[:, None])[None]
    masked, seen = (oracle_probs(model, tok, prompt, [[None, None, "c"]], attn)[0, 0]
                    for attn in (causal, torch.ones(1, T, T, dtype=torch.bool)))
    a, c = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("c")
    assert masked[c] == pytest.approx(1 / 3) and masked[a] == pytest.approx(1 / 3)
    assert seen[c] == pytest.approx(0.0, abs=1e-9) and seen[a] == pytest.approx(1 / 2)


def test_latin_squares_of_order_4_are_the_576_of_an_independent_enumeration():
    perms = list(itertools.permutations(range(4)))
    squares = {sum(rows, ()) for rows in itertools.product(perms, repeat=4)
               if all(len({r[k] for r in rows}) == 4 for k in range(4))}
    assert len(squares) == 576 and set(latin_squares(4)) == squares
    assert len(latin_squares(3)) == 12 and len(latin_squares(2)) == 2


def test_latin_square_in_one_step_is_576_over_4_to_the_16(tok):
    """On the empty canvas every cell's marginal is uniform over the 4 symbols, so committing all 16
    cells at once is valid with probability 576 / 4**16 (and the marginals are exact: 1/4, not 1/3)."""
    model = OracleLM("latin_square", tok)
    probs = oracle_probs(model, tok, "latin_square:abcd=", [[None] * 16])[0]
    ids = [tok.convert_tokens_to_ids(c) for c in "abcd"]
    assert torch.allclose(probs[:, ids], torch.full((16, 4), 0.25, dtype=torch.float64), atol=1e-7)
    assert 576 / 4 ** 16 == pytest.approx(math.prod([0.25] * 16) * len(latin_squares(4)))


# ---------------------------------------------------------------------------------------- closed forms

def shuffle_closed_form(n: int, per_step: list[int]) -> float:
    p, m = 1.0, n
    for k in per_step:
        p *= math.factorial(m) / (math.factorial(m - k) * m ** k)
        m -= k
    return p


def lowconf(block: int, steps: int) -> dict:
    return {"m2t": {"name": "topk", "params": {"steps_per_block": steps, "ranking": "low_confidence"}},
            "t2t": {"name": "none"}, "remask": {"name": "none"},
            "blocks": {"name": "semi_ar", "params": {"block_length": block, "max_post_steps": 0, "align": "prompt"}},
            "sampling": {"temperature": 1.0}}


def within_99(acc: float, p: float, n: int) -> bool:
    half = 2.576 * math.sqrt(max(p * (1 - p), 1e-12) / n) + 1e-12
    return abs(acc - p) <= half


@pytest.mark.parametrize("steps, per_step, exact, n", [
    (1, [6], 720 / 46656, 1000), (3, [2, 2, 2], 0.3125, 800), (6, [1] * 6, 1.0, 200), (2, [3, 3], None, 600)])
def test_shuffle_fixed_quota_reproduces_the_closed_form(steps, per_step, exact, n):
    """n = 6 items, k_j committed in step j: prod_j m_j! / ((m_j - k_j)! m_j^k_j) within its 99 %
    interval; the near miss: the closed form of the neighbouring quota lies outside it."""
    model, tok = load_oracle("oracle:list_shuffle")
    p = shuffle_closed_form(6, per_step)
    if exact is not None:
        assert p == pytest.approx(exact, abs=1e-4)
    acc = evaluate(model, tok, get_task("list_shuffle", n_items=6), lowconf(6, steps), n, batch_size=n,
                   progress=False).metrics["accuracy"]
    assert within_99(acc, p, n), (acc, p)
    neighbours = {1: [[5, 1]], 3: [[3, 2, 1], [1, 2, 2, 1]], 6: [[2, 1, 1, 1, 1]], 2: [[2, 2, 2], [4, 2]]}[steps]
    for q in (shuffle_closed_form(6, k) for k in neighbours):
        assert not within_99(acc, q, n), (acc, q)


@pytest.mark.parametrize("steps, p", [(1, (5 / 6) ** 5), (6, 1.0)])
def test_replace_closed_form(steps, p):
    """Replace, n = 6, whole answer in one step: ((n-1)/n)^(n-1) = 0.4019; one per step: 1.0."""
    model, tok = load_oracle("oracle:list_replace")
    n = 800 if steps == 1 else 200
    acc = evaluate(model, tok, get_task("list_replace", n_items=6), lowconf(6, steps), n, batch_size=n,
                   progress=False).metrics["accuracy"]
    assert within_99(acc, p, n), (acc, p)
    if steps == 1:
        assert p == pytest.approx(0.4019, abs=1e-4) and not within_99(acc, 0.5, n)


@pytest.mark.parametrize("kind", ["list_copy", "list_reverse", "list_sort", "list_insert"])
def test_deterministic_answers_are_exact_in_one_forward(kind):
    """Copy, reverse and sort: accuracy 1.0 with the whole answer in one forward; insert (n+1
    answers, not deterministic) is the near miss: one forward loses accuracy, one per step does not."""
    model, tok = load_oracle(f"oracle:{kind}")
    task = get_task(kind, n_items=8, alphabet=62)
    width = task.answer_length
    one = evaluate(model, tok, task, lowconf(width, 1), 300, batch_size=300, progress=False).metrics
    if kind == "list_insert":
        assert one["accuracy"] < 0.9
        slow = evaluate(model, tok, task, lowconf(width, width), 100, batch_size=100, progress=False)
        assert slow.metrics["accuracy"] == 1.0
    else:
        assert one["accuracy"] == 1.0 and one["nfe_mean"] == 2.0  # the answer's block, then the EOS block


# ---------------------------------------------------------------------------------------- refusals

def test_refusals_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"unknown oracle task 'list_nope'; oracle tasks: list_copy"):
        load_checkpoint("oracle:list_nope")
    model, tok = load_checkpoint("oracle:list_shuffle")
    with pytest.raises(ValueError, match=r"models task 'list_shuffle' but the task is 'list_copy'"):
        evaluate(model, tok, "list_copy", lowconf(6, 1), 2, progress=False)
    ids = torch.tensor([tok.encode("list_copy:abc=") + [model.mask_token_id] * 3])
    with pytest.raises(ValueError, match=r"batch row 0 does not start with a list_shuffle prompt"):
        model.forward_window(ids, torch.arange(ids.shape[1])[None], torch.ones(1, 17, 17, dtype=torch.bool))
    for kwargs, match in [({"n_items": 1}, r"n_items must be in 2\.\.16, got 1"),
                          ({"n_items": 17}, r"n_items must be in 2\.\.16, got 17"),
                          ({"n_items": 6, "alphabet": 5}, r"alphabet must be in 6\.\.62"),
                          ({"n_items": 6, "alphabet": 63}, r"alphabet must be in 6\.\.62")]:
        with pytest.raises(ValueError, match=match):
            get_task("list_shuffle", **kwargs)
    get_task("list_shuffle", n_items=16, alphabet=16)  # the bounds themselves are accepted
    get_task("list_shuffle", n_items=2, alphabet=62)
    with pytest.raises(ValueError, match=r"alphabet must be in 7\.\.62"):
        get_task("list_replace", n_items=6, alphabet=6)  # the new item needs one more
    with pytest.raises(ValueError, match=r"order must be in 2\.\.4, got 5"):
        get_task("latin_square", order=5)
    with pytest.raises(ConfigError, match="its options"):
        get_task("latin_square", n_items=4)


def test_tasks_score_every_valid_answer_and_nothing_else():
    for kind, kwargs in [("list_shuffle", {"n_items": 4}), ("list_shuffle", {"n_items": 3, "exclude_original": True}),
                         ("list_replace", {"n_items": 3}), ("list_insert", {"n_items": 3}),
                         ("list_sort", {"n_items": 4, "alphabet": 62}), ("latin_square", {"order": 3})]:
        task = get_task(kind, **kwargs)
        for inst in task.instances(3, seed=1, split="eval"):
            p = parse_prompt(inst.prompt)
            assert task.score(inst, inst.reference) == 1.0
            answers = set(brute_answers(kind, p.items, p.extra, p.exclude_original))
            symbols = p.items + p.extra
            for s in itertools.product(symbols, repeat=len(inst.reference)):
                s = "".join(s)
                assert task.score(inst, s) == float(s in answers), (inst.prompt, s)
            assert task.score(inst, inst.reference[:-1]) == 0.0


@pytest.mark.parametrize("kind", ["list_shuffle", "latin_square", "list_insert"])
def test_instance_stream_is_seeded_split_disjoint_and_prefix_stable(kind):
    task = get_task(kind)
    a = task.instances(60, seed=3, split="eval")
    assert [i.prompt for i in a] == [i.prompt for i in get_task(kind).instances(60, seed=3, split="eval")]
    assert [i.prompt for i in task.instances(20, seed=3, split="eval")] == [i.prompt for i in a[:20]]
    assert [i.prompt for i in a] != [i.prompt for i in task.instances(60, seed=4, split="eval")]
    train = {i.prompt for i in task.instances(400, seed=3, split="train")}
    assert not train & {i.prompt for i in a}
    assert all(len(i.reference) == task.answer_length for i in a)
