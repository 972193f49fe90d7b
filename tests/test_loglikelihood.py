"""lm-eval ``loglikelihood`` by the Monte-Carlo masked-diffusion ELBO: against the exact ELBO,
enumerated on canvases small enough (a plain per-block re-implementation, not the estimator's
``[x_t ; x_0]`` layout); exact for a one-token continuation; the testbed picks its own tasks'
answers out of near-miss options through lm-eval's ``simple_evaluate``; bad input is one line."""

from __future__ import annotations

import itertools
import json
import math
import re
import random
from pathlib import Path

import pytest
import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.integrations.loglik import MAX_MC_NUM, estimate_loglikelihood
from dlm_toolkit.tasks import get_task
from dlm_toolkit.testing.models import tiny_llada2

REPO = Path(__file__).resolve().parents[1]
TESTBED = REPO / "checkpoints" / "testbed-v2-editable"
MASK = 15


@pytest.fixture(scope="module")
def tiny():
    """Moderate logits (every conditional far from 0 and 1: all the bound's terms matter) and
    attention scaled up so that the conditionals depend on the context (a plain random init
    barely looks at it, and a wrong attention layout would go unnoticed)."""
    model = tiny_llada2(0, logit_scale=10.0, vocab_size=16, mask_token_id=MASK, eos_token_id=14)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "query_key_value" in name:
                param.mul_(5)
            if "attention.dense" in name:
                param.mul_(20)
    return model


def plain_logp(model, canvas: list[int], at: int, token: int, B: int) -> float:
    """log p(token at ``at``) from one forward of ``canvas`` under plain block-causal attention."""
    n = len(canvas)
    i = torch.arange(n)
    attn = (i[None, :] // B <= i[:, None] // B)[None]
    logits = model.forward_window(torch.tensor([canvas]), i[None], attn)
    return float(torch.log_softmax(logits[0, at].double(), -1)[token])


def enumerated_elbo(model, ctx: list[int], cont: list[int], B: int, mask: int = MASK, cut: bool = False) -> float:
    """The block-wise ELBO by enumeration: for each block b, the canvas is the context and the
    earlier blocks clean, block b with every nonempty subset S of its continuation positions
    masked (and positions past the continuation masked), cut at the block's end (``cut``: at the
    continuation's end, where that comes first -- LLaDA's convention);
    E_{k ~ U{1..l}, S ~ U(k-subsets)} (l/k) sum_{i in S} log p = sum_S sum_i log p / (k C(l, k))."""
    P = len(ctx)
    total = 0.0
    with torch.no_grad():
        for b in sorted({(P + j) // B for j in range(len(cont))}):
            lo, hi = b * B, (b + 1) * B
            end = min(hi, P + len(cont)) if cut else hi
            mine = [P + j for j in range(len(cont)) if lo <= P + j < hi]
            l = len(mine)
            for k in range(1, l + 1):
                for subset in itertools.combinations(mine, k):
                    canvas = ([*ctx, *cont] + [mask] * hi)[:end]
                    for p in subset:
                        canvas[p] = mask
                    for p in subset:
                        total += plain_logp(model, canvas, p, cont[p - P], B) / (k * math.comb(l, k))
    return total


@pytest.mark.parametrize("ctx, cont", [
    ([1, 2, 3, 4, 5], [6, 7, 8]),  # one block holds all 3 continuation positions (positions 5..7)
    ([1, 2, 3], [9, 4, 7]),  # 1 position in block 0 (with the context), 2 in block 1 (4..5) + a masked pad
])
def test_estimate_converges_to_the_enumerated_elbo_within_its_error(tiny, ctx, cont):
    exact = enumerated_elbo(tiny, ctx, cont, 4)
    est = estimate_loglikelihood(tiny, ctx, cont, 4, mc_num=3000, mc_batch_size=1000,
                                 generator=torch.Generator().manual_seed(3))
    assert not est.exact and est.samples == 3000
    assert 0 < est.stderr < 0.05  # small enough that the comparison has power
    assert abs(est.logprob - exact) < 4 * est.stderr
    # near-miss: the same tokens in another order (the model must read the context) is far off
    other = enumerated_elbo(tiny, ctx, [cont[0], cont[2], cont[1]], 4)
    assert abs(est.logprob - other) > 4 * est.stderr


def test_testbed_estimate_matches_its_enumerated_elbo():
    """The trained testbed (strongly context-dependent), blocks of 4: '12+34=' then '47' (a wrong
    sum, so the terms are far from 0) spans the block of the context's tail and the next."""
    from dlm_toolkit.evaluation.evaluate import load_checkpoint

    model, tok = load_checkpoint(TESTBED)
    ctx, cont = tok.encode("12+34=", add_special_tokens=False), tok.encode("47", add_special_tokens=False)
    exact = enumerated_elbo(model, ctx, cont, 4, mask=model.mask_token_id)
    est = estimate_loglikelihood(model, ctx, cont, 4, mc_num=400, mc_batch_size=400,
                                 generator=torch.Generator().manual_seed(0))
    assert exact < -3 and 0 < est.stderr < 0.5
    assert abs(est.logprob - exact) < 4 * est.stderr
    right = estimate_loglikelihood(model, ctx, tok.encode("46", add_special_tokens=False), 4, mc_num=8)
    assert right.greedy and not est.greedy and right.logprob > est.logprob + 1


def test_full_attention_model_is_one_block_without_padding(tiny, monkeypatch):
    """A full-attention model (LLaDA-1 style): context and continuation one canvas, no mask padding,
    every position seeing every other -- LLaDA's own estimator, against its enumeration."""
    monkeypatch.setattr(tiny, "attention", "full")
    ctx, cont = [1, 2, 3, 4, 5], [6, 7, 8]
    exact = 0.0
    with torch.no_grad():
        for k in range(1, 4):
            for subset in itertools.combinations(range(3), k):
                canvas = [*ctx, *[MASK if j in subset else t for j, t in enumerate(cont)]]
                n = len(canvas)
                logits = tiny.forward_window(torch.tensor([canvas]), torch.arange(n)[None], torch.ones(1, n, n, dtype=torch.bool))
                logp = torch.log_softmax(logits[0].double(), -1)
                exact += sum(float(logp[5 + j, cont[j]]) for j in subset) / (k * math.comb(3, k))
    est = estimate_loglikelihood(tiny, ctx, cont, 4, mc_num=3000, mc_batch_size=1000,
                                 generator=torch.Generator().manual_seed(5))
    assert 0 < est.stderr < 0.05 and abs(est.logprob - exact) < 4 * est.stderr
    assert abs(enumerated_elbo(tiny, ctx, cont, 4) - exact) > 10 * est.stderr  # block-causal scoring differs


def test_one_token_per_block_is_exact_log_p(tiny):
    """A one-token continuation: log p of that token, the block's rest masked (one forward, no
    error); one token in each of two blocks: the sum of the two exact conditionals."""
    with torch.no_grad():
        one = plain_logp(tiny, [1, 2, 3, 4, 5, MASK, MASK, MASK], 5, 6, 4)
        two = plain_logp(tiny, [1, 2, 3, MASK], 3, 9, 4) + plain_logp(tiny, [1, 2, 3, 9, MASK, MASK, MASK, MASK], 4, 5, 4)
    est = estimate_loglikelihood(tiny, [1, 2, 3, 4, 5], [6], 4, mc_num=2)
    assert est.exact and est.stderr == 0.0 and est.samples == 1
    assert est.logprob == pytest.approx(one, abs=1e-5)
    pair = estimate_loglikelihood(tiny, [1, 2, 3], [9, 5], 4, mc_num=2)
    assert pair.exact and pair.logprob == pytest.approx(two, abs=1e-5)
    assert enumerated_elbo(tiny, [1, 2, 3], [9, 5], 4) == pytest.approx(two, abs=1e-9)  # the reference agrees
    near = estimate_loglikelihood(tiny, [1, 2, 3, 4, 5], [7], 4, mc_num=2)
    assert near.logprob != pytest.approx(one, abs=1e-3)
    assert estimate_loglikelihood(tiny, [1, 2], [], 4, mc_num=2).logprob == 0.0


def test_greedy_means_every_token_is_the_argmax_with_its_block_masked(tiny):
    """lm-eval's is_greedy: block by block (earlier blocks clean), the whole continuation of the
    block masked, each of its tokens is the argmax. The reference continuation is built that way."""
    ctx, B = [1, 2, 3], 4
    greedy = []
    with torch.no_grad():
        for b_end in (4, 8):  # positions 3 | 4, 5, 6
            canvas = ([*ctx, *greedy] + [MASK] * 8)[:b_end]
            i = torch.arange(b_end)
            logits = tiny.forward_window(torch.tensor([canvas]), i[None], (i[None, :] // B <= i[:, None] // B)[None])
            greedy += logits[0, len(ctx) + len(greedy):b_end].argmax(-1).tolist()[: 4 - len(greedy)]
    assert estimate_loglikelihood(tiny, ctx, greedy, B, mc_num=4).greedy
    for j in range(4):  # the near-misses: any one token off
        off = [*greedy]
        off[j] = (off[j] + 1) % 14
        assert not estimate_loglikelihood(tiny, ctx, off, B, mc_num=4).greedy


def test_estimate_is_reproducible_from_its_seed(tiny):
    def run(seed: int, batch: int) -> float:
        return estimate_loglikelihood(tiny, [1, 2], [3, 4, 5], 4, mc_num=12, mc_batch_size=batch,
                                      generator=torch.Generator().manual_seed(seed)).logprob

    assert run(0, 12) == run(0, 12)
    assert run(0, 12) != run(1, 12)


@pytest.mark.parametrize("mc_num, mc_batch_size, needle", [
    (0, 4, "mc_num"), (1, 4, "mc_num"), (MAX_MC_NUM + 1, 4, "mc_num"), (True, 4, "mc_num"), ("8", 4, "mc_num"),
    (8, 0, "mc_batch_size"), (8, 10**6, "mc_batch_size"),
])
def test_bad_mc_arguments_are_one_line(tiny, mc_num, mc_batch_size, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        estimate_loglikelihood(tiny, [1], [2, 3], 4, mc_num=mc_num, mc_batch_size=mc_batch_size)
    assert "\n" not in str(err.value)
    estimate_loglikelihood(tiny, [1], [2, 3], 4, mc_num=2, mc_batch_size=1)  # the smallest accepted


# -- through lm-eval -----------------------------------------------------------------------------

MC_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""

N_MC = {"add": 12, "sort": 6}


def near_misses(reference: str, rng: random.Random, n: int = 3) -> list[str]:
    """``n`` wrong options of the answer's length: one digit changed."""
    out: set[str] = set()
    digits = [j for j, ch in enumerate(reference) if ch.isdigit()]
    while len(out) < n:
        j = rng.choice(digits)
        out.add(reference[:j] + rng.choice([d for d in "0123456789" if d != reference[j]]) + reference[j + 1:])
    return sorted(out)


@pytest.fixture(scope="module")
def mc_tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mc_tasks")
    rng = random.Random(0)
    for name, n in N_MC.items():
        rows = []
        for inst in get_task(name).instances(n, 0, "eval"):
            choices = near_misses(inst.reference, rng)
            label = rng.randrange(4)
            choices.insert(label, inst.reference)
            rows.append({"prompt": inst.prompt, "choices": choices, "label": label})
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"dlm_mc_{name}.yaml").write_text(MC_YAML.format(name=f"dlm_mc_{name}", data=data))
    return folder


def test_simple_evaluate_multiple_choice_picks_the_testbeds_answers(mc_tasks, monkeypatch):
    """Four options (the answer at a random place, three one-digit near-misses): chance is 0.25;
    the testbed, scored through loglikelihood, picks the answer nearly always."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import dlm_toolkit.integrations.lm_eval  # noqa: F401  (registers "dlm")

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = lm_eval.simple_evaluate(
        model="dlm", model_args=f"pretrained={TESTBED},mc_num=8,mc_batch_size=8,threads=1,seed=0",
        tasks=[f"dlm_mc_{t}" for t in N_MC], task_manager=TaskManager(include_path=str(mc_tasks), include_defaults=False))
    for name in N_MC:
        assert out["results"][f"dlm_mc_{name}"]["acc,none"] >= 0.75
    info = out["config"]["dlm"]["loglikelihood"]
    assert info["requests"] == 4 * sum(N_MC.values()) and info["mc_num"] == 8
    per = info["per_request"]
    assert all(r["stderr"] >= 0 and r["samples"] in (1, 8) for r in per)
    assert any(r["stderr"] > 0 for r in per)  # multi-token options carry a real error


def test_lm_eval_model_arguments_and_request_bounds(caplog):
    from lm_eval.api.instance import Instance

    from dlm_toolkit.integrations.lm_eval import DlmLM, request_seeds

    lm = DlmLM(pretrained=str(TESTBED), threads=1, mc_num=4, mc_batch_size=4)
    assert lm.checkpoint == str(TESTBED)
    with pytest.raises(ConfigError, match="checkpoint or pretrained"):
        DlmLM(checkpoint=str(TESTBED), pretrained=str(REPO / "checkpoints" / "testbed-editable"))
    with pytest.raises(ConfigError, match="checkpoint=DIR"):
        DlmLM(preset="llada2.1-q")
    with pytest.raises(ConfigError, match="mc_num"):
        DlmLM(checkpoint=str(TESTBED), mc_num=0)

    fits = Instance("loglikelihood", {}, ("1+2=", "3"), 0)
    long = Instance("loglikelihood", {}, ("1+2=" * 60, "3" * 30), 0)  # 270 characters > 256 positions
    with pytest.raises(ConfigError, match="max_position_embeddings") as err:
        lm.loglikelihood([fits, long], disable_tqdm=True)
    assert "allow-past-context=" not in str(err.value) and lm.loglik_log == []  # refused before scoring

    # the same request scores the same alone and after others (its seed is its own); two copies differ
    a = Instance("loglikelihood", {}, ("12+34=", "46"), 0, ("t", 5, 1))
    b = Instance("loglikelihood", {}, ("12+34=", "64"), 0, ("t", 6, 1))
    with caplog.at_level("INFO", logger="dlm_toolkit.integrations.lm_eval"):
        alone = lm.loglikelihood([a], disable_tqdm=True)[0]
    assert f"dlm loglikelihood: 1 requests, mc_num 4, standard error mean {lm.loglik_log[-1]['stderr']:.4g}" in caplog.text
    assert lm.loglikelihood([b, fits, a], disable_tqdm=True)[2] == alone
    seeds = request_seeds(0, [a, a, b])
    assert seeds[0] != seeds[1] != seeds[2] and request_seeds(0, [b, a])[1] == seeds[0]


def test_loglikelihood_rolling_sums_windows_of_half_the_context():
    """The testbed's context is 256: a 200-character text is two windows of 128, the second
    conditioned on the first; each window's estimate is the one a loglikelihood request gets."""
    from lm_eval.api.instance import Instance

    from dlm_toolkit.integrations.lm_eval import DlmLM, request_seeds

    lm = DlmLM(checkpoint=str(TESTBED), threads=1, mc_num=2, mc_batch_size=2)
    text = "".join(f"{i}+{i}={2 * i};" for i in range(30))[:200]
    req = Instance("loglikelihood_rolling", {}, (text,), 0)
    total = lm.loglikelihood_rolling([req], disable_tqdm=True)[0]
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 200
    gen = torch.Generator().manual_seed(request_seeds(0, [req])[0])
    first = estimate_loglikelihood(lm.model, [], ids[:128], 32, mc_num=2, mc_batch_size=2, generator=gen)
    second = estimate_loglikelihood(lm.model, ids[:128], ids[128:], 32, mc_num=2, mc_batch_size=2, generator=gen)
    assert total == pytest.approx(first.logprob + second.logprob, rel=1e-9)
    assert lm.loglik_log[-1]["stderr"] == pytest.approx(math.hypot(first.stderr, second.stderr))


# -- memory: a forward that cannot fit is refused before it runs ---------------------------------------
def test_forward_length_is_the_length_of_the_forward_that_runs(tiny, monkeypatch):
    from dlm_toolkit.integrations.loglik import forward_length, forward_shape

    seen = []
    inner = tiny.forward_window
    monkeypatch.setattr(tiny, "forward_window", lambda ids, *a, **k: seen.append(tuple(ids.shape)) or inner(ids, *a, **k))
    for P, l, last in ((3, 2, "pad"), (4, 1, "pad"), (5, 7, "cut"), (0, 9, "pad"), (8, 4, "cut")):
        seen.clear()
        estimate_loglikelihood(tiny, list(range(1, P + 1)), [2] * l, 4, mc_num=5, mc_batch_size=3, last_block=last)
        rows, length = forward_shape(tiny, P, l, 4, 5, 3, last)
        assert {s[1] for s in seen} == {forward_length(tiny, P, l, 4, last)} == {length}
        assert max(s[0] for s in seen) == rows  # 1 where exact, else the batch and the greedy row


def test_forward_bytes_counts_the_logits_twice_and_the_mask(tiny):
    from dlm_toolkit.integrations.loglik import forward_bytes

    # fp32 model, V = 16: logits 4 + 4 bytes a value, the additive mask 4 bytes and the bool 1
    assert forward_bytes(tiny, 3, 10) == 3 * 10 * 16 * 8 + 3 * 10 * 10 * 5


def test_a_forward_over_the_budget_is_refused_naming_the_batch_that_fits(tiny):
    from dlm_toolkit.integrations.loglik import check_forward_memory, forward_bytes

    need = forward_bytes(tiny, 33, 40)
    check_forward_memory(tiny, 33, 40, budget=need)  # near miss: exactly the budget
    with pytest.raises(ConfigError, match=r"^mc_batch_size: a loglikelihood forward of 33 rows over 40 positions needs "
                                          r"~0\.0 GiB .* more than the 0\.0 GiB allowed .*: use mc_batch_size <= (\d+)$") as err:
        check_forward_memory(tiny, 33, 40, budget=need - 1)
    fits = int(re.search(r"<= (\d+)$", str(err.value)).group(1))
    assert forward_bytes(tiny, fits + 1, 40) <= need - 1 < forward_bytes(tiny, fits + 2, 40)
    with pytest.raises(ConfigError, match="even one sample does not fit: shorten the request"):
        check_forward_memory(tiny, 2, 40, budget=forward_bytes(tiny, 1, 40) - 1)


def test_an_estimate_too_large_for_this_machine_is_refused_before_its_first_forward(monkeypatch):
    """The real budget (half of this machine's memory): 4097 rows of a 65,536-token vocabulary over
    ~800 positions need ~1.7 TB of logits."""
    big = tiny_llada2(0, vocab_size=65536, mask_token_id=65535, eos_token_id=65534)
    calls = []
    monkeypatch.setattr(big, "forward_window", lambda *a, **k: calls.append(1))
    with pytest.raises(ConfigError, match=r"^mc_batch_size: a loglikelihood forward of 4097 rows over \d+ positions"):
        estimate_loglikelihood(big, list(range(1, 301)), list(range(1, 101)), 4, mc_num=8192, mc_batch_size=4096)
    assert calls == []


def test_lm_eval_checks_every_request_before_scoring_any(monkeypatch):
    from lm_eval.api.instance import Instance

    from dlm_toolkit.integrations import loglik
    from dlm_toolkit.integrations.lm_eval import DlmLM

    lm = DlmLM(checkpoint=str(TESTBED), threads=1, mc_num=64, mc_batch_size=64)
    short = Instance("loglikelihood", {}, ("1+2=", "3"), 0)
    long = Instance("loglikelihood", {}, ("1+2=" * 20, "123456"), 0)
    budget = loglik.forward_bytes(lm.model, *loglik.forward_shape(lm.model, 4, 1, 32, 64, 64))  # the short one fits
    monkeypatch.setattr(loglik, "memory_for_forwards", lambda model: budget)  # a machine this small
    with pytest.raises(ConfigError, match=r"^mc_batch_size: a loglikelihood forward of 65 rows over 96 positions"):
        lm.loglikelihood([short, long], disable_tqdm=True)
    assert lm.loglik_log == []  # the first request was not scored either
    with pytest.raises(ConfigError, match=r"^mc_batch_size: a loglikelihood forward of 65 rows over \d+ positions"):  # rolling too
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("1+2=" * 20,), 0)], disable_tqdm=True)
    assert len(lm.loglikelihood([short], disable_tqdm=True)) == 1  # near miss: it fits alone
