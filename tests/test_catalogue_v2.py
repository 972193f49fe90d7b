"""Catalogue v2 (issue 26): WINO, DUS, PC-Sampler, T2M and the learned commit rule on hand-worked
examples, each decoded end to end against a plain-Python, float64 reimplementation of its paper's loop
on a small random model, the catalogue sweep, and the comparison table at small size (the contract
suites run the rules in tests/test_contracts.py)."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from dlm_toolkit import DecodingPolicy
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.strategy.registry import M2T, REMASK
from dlm_toolkit.testing import make_context
from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits
from strategies.m2t_dus import dilated_group
from test_strategies_catalogue import M, conf, selected  # hand-built logits over a 10-token vocab, mask 9

VOCAB, MASK, EOS = 24, 23, 22  # the random model's vocabulary


# -- hand-worked examples ------------------------------------------------------------------------


def test_dus_groups_bisect_the_gaps():
    # n = 8, base 2: {0, 4}, then {2, 6}, then the odd offsets: 3 forwards = log2(8)
    offset = torch.arange(8)[None]
    assert dilated_group(offset, torch.tensor([8]), 2)[0].tolist() == [0, 2, 1, 2, 0, 2, 1, 2]
    # n = 16: 4 forwards; n = 5: ceil(log2 5) = 3 forwards, offsets 0 and 4 first
    assert dilated_group(torch.arange(16)[None], torch.tensor([16]), 2)[0].max().item() == 3
    assert dilated_group(torch.arange(5)[None], torch.tensor([5]), 2)[0].tolist() == [0, 2, 1, 2, 0]
    # base 3, n = 9: {0, 3, 6} then the rest: 2 forwards = log3(9)
    assert dilated_group(torch.arange(9)[None], torch.tensor([9]), 3)[0].tolist() == [0, 1, 1, 0, 1, 1, 0, 1, 1]


def test_dus_commits_its_group_whatever_the_confidence():
    # block of 8 after a 2-token prompt (offsets count from the first generated position)
    tokens = torch.tensor([[1, 2] + [M] * 8])
    logits = conf((0.9, 1), (0.9, 2), *[(0.99 if i % 2 else 0.2, 3) for i in range(8)])
    rule = M2T.get("dus")()
    assert selected(rule(make_context(tokens, logits, mask_token_id=M, prompt_len=2))) == [2, 6]
    assert selected(rule(make_context(tokens, logits, mask_token_id=M, prompt_len=2, block_step=1))) == [2, 4, 6, 8]
    # group 0 already written: at step 0 the fallback is the best mask of the lowest group left
    tokens = torch.tensor([[1, 2, 5, M, M, M, 5, M, M, M]])
    assert selected(rule(make_context(tokens, logits, mask_token_id=M, prompt_len=2))) == [4]


def test_dus_fills_a_block_in_log2_forwards_on_a_real_decode():
    model = ScriptedLM(mixing_logits(VOCAB, seed=3), VOCAB, MASK, EOS)
    policy = {"m2t": {"name": "dus"}, "t2t": {"name": "none"},
              "blocks": {"name": "semi_ar", "params": {"block_length": 16, "max_post_steps": 0, "eos_early_stop": False}}}
    res = decode(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]], policy, gen_length=64)
    assert res.rows[0].nfe == 4 * 4  # 4 blocks of 16, log2(16) = 4 forwards each
    thr = decode(model, [list(range(1, 17))], {**policy, "m2t": {"name": "topk", "params": {"steps_per_block": 16}}}, 64)
    assert thr.rows[0].nfe == 64


def test_pc_sampler_prefers_informative_early_tokens():
    # four masks: token 1 is predicted at three of them (trivial for this canvas), token 4 once
    tokens = torch.full((1, 4), M)
    logits = conf((0.7, 1), (0.8, 1), (0.6, 4), (0.75, 1))
    ctx = make_context(tokens, logits, mask_token_id=M)
    p_bg = ctx.probs[0].double().mean(0)  # the background: mean prediction over the window
    assert p_bg[1] > 0.5 > p_bg[4]
    one = M2T.get("pc_sampler")(steps_per_block=4, lam=0.0)  # quota 1, no position decay
    assert selected(one(ctx)) == [2]  # plain confidence would take position 1
    assert selected(M2T.get("topk")(steps_per_block=4)(ctx)) == [1]
    # a strong position decay brings back left to right
    assert selected(M2T.get("pc_sampler")(steps_per_block=4, lam=5.0)(ctx)) == [0]
    # the score itself, by hand: w * -p * log(p_bg)
    lam = 0.25
    want = [math.exp(-lam * i) * -p * math.log(p_bg[t].item()) for i, (p, t) in enumerate([(0.7, 1), (0.8, 1), (0.6, 4), (0.75, 1)])]
    from strategies.m2t_pc_sampler import pc_score

    assert pc_score(ctx, lam, 1e-3)[0].tolist() == pytest.approx(want, rel=1e-4)
    # offsets count from the block's first generated position, not from the canvas start (where
    # exp(-lambda * 4000) would underflow every score to 0)
    ctx.positions = ctx.positions + 4000
    assert pc_score(ctx, lam, 1e-3)[0].tolist() == pytest.approx(want, rel=1e-4)
    # epsilon floors the background: with every p_bg under 0.9 floored, the score is confidence times a constant
    assert selected(M2T.get("pc_sampler")(steps_per_block=4, lam=0.0, epsilon=0.9)(ctx)) == [1]


def test_pc_sampler_background_skips_left_padding():
    # two padding positions (valid False) predict token 4 confidently: they are not part of the canvas
    tokens = torch.full((1, 6), M)
    logits = conf((0.99, 4), (0.99, 4), (0.7, 1), (0.8, 1), (0.6, 4), (0.75, 1))
    valid = torch.tensor([[False, False, True, True, True, True]])
    ctx = make_context(tokens, logits, mask_token_id=M, valid=valid, in_block=valid)
    assert selected(M2T.get("pc_sampler")(steps_per_block=4, lam=0.0)(ctx)) == [4]  # as without padding


def remask_ctx(commit: list[int], written_conf: list[float], written_step: list[int], step: int = 5):
    # pos0 prompt; pos1..4 written with p(own token) now 0.2, 0.45, 0.3, 0.95; pos5..8 masked
    tokens = torch.tensor([[1, 2, 3, 4, 5, M, M, M, M]])
    logits = conf((0.9, 1), (0.2, 2), (0.45, 3), (0.3, 4), (0.95, 5), (0.9, 1), (0.9, 1), (0.9, 1), (0.9, 1))
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1, step=step,
                       written_conf=torch.tensor([[0.0] + written_conf + [0.0] * 4]),
                       written_step=torch.tensor([[-1] + written_step + [-1] * 4]))
    ctx.commit = torch.zeros_like(ctx.masked)
    ctx.commit[0, commit] = True
    ctx.edit = torch.zeros_like(ctx.masked)
    return ctx


def test_t2m_remasks_tokens_whose_support_collapsed():
    rule = REMASK.get("t2m")(drop=0.5, floor=0.5, min_age=1)
    # written with 0.9, 0.5, 0.95, 0.99; now 0.2, 0.45, 0.3, 0.95: ratios 0.22, 0.9, 0.32, 0.96
    ctx = remask_ctx([5, 6, 7, 8], [0.9, 0.5, 0.95, 0.99], [1, 1, 1, 1])
    assert selected(rule(ctx)) == [1, 3]  # pos 2 fell little (0.45 of 0.5); pos 4 is still supported
    assert selected(rule(remask_ctx([5, 6], [0.9, 0.5, 0.95, 0.99], [1, 1, 1, 1]))) == [1]  # budget 1: largest collapse
    assert selected(rule(remask_ctx([5], [0.9, 0.5, 0.95, 0.99], [1, 1, 1, 1]))) == []  # one commit: no budget
    # written in the step before (age 1) is judged; min_age 2 spares it
    young = remask_ctx([5, 6, 7, 8], [0.9, 0.5, 0.95, 0.99], [4, 1, 1, 1])
    assert selected(REMASK.get("t2m")(min_age=2)(young)) == [3]
    # floor: a token still above it is kept, however far it fell (pos 2: 0.45 of 0.99)
    fell = remask_ctx([5, 6, 7, 8], [0.9, 0.99, 0.95, 0.99], [1, 1, 1, 1])
    assert selected(REMASK.get("t2m")(drop=0.9, floor=0.4)(fell)) == [1, 3]
    assert selected(REMASK.get("t2m")(drop=0.9, floor=0.5)(fell)) == [1, 2, 3]
    # ranked by the fall, not by the probability now: pos 1 is lowest (0.2) but was written with 0.25
    low_start = remask_ctx([5, 6], [0.25, 0.99, 0.95, 0.99], [1, 1, 1, 1])
    assert selected(REMASK.get("t2m")(drop=0.9, floor=0.5)(low_start)) == [3]  # ratios 0.8, 0.45, 0.32
    # the plain low-confidence remask ignores the history: it would take pos 2 too
    assert selected(REMASK.get("low_confidence")(threshold=0.5)(ctx)) == [1, 2, 3]


def test_wino_drafts_wide_and_verifies_narrow():
    tokens = torch.tensor([[1, 2, 3, M, M, M, M]])
    logits = conf((0.9, 1), (0.85, 2), (0.5, 3), (0.65, 4), (0.62, 5), (0.3, 6), (0.95, 7))
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1)
    commit = M2T.get("wino")()(ctx)  # tau_1 = 0.6: wide-in drafts three masks
    assert selected(commit) == [3, 4, 6]
    assert selected(M2T.get("threshold")()(ctx)) == [6]  # the default 0.9 commit drafts one
    ctx.commit, ctx.edit = commit, torch.zeros_like(commit)
    # tau_2 = 0.9: both earlier drafts (0.85, 0.5) fail verification; budget 3 - 1 = 2
    assert selected(REMASK.get("wino")()(ctx)) == [1, 2]
    assert selected(REMASK.get("wino")(threshold=0.6)(ctx)) == [2]


# -- a plain-loop reference decoder ----------------------------------------------------------------
# One prompt, semi-AR blocks aligned at 0, no post steps, no EOS stop, greedy: every forward sees the
# canvas up to the active block's end under block-causal attention. Rules are plain-Python functions
# of (view, masks) over float64 probabilities; they return positions.


class View:
    """What one forward of the reference gives a rule (absolute positions, float64)."""

    def __init__(self, probs: torch.Tensor, canvas: list[int], lo: int, hi: int, prompt_len: int, step: int,
                 block_step: int, masks_at_start: int, written_step: dict[int, int], written_conf: dict[int, float]):
        self.probs, self.canvas, self.lo, self.hi, self.prompt_len = probs, canvas, lo, hi, prompt_len
        self.step, self.block_step, self.masks_at_start = step, block_step, masks_at_start
        self.written_step, self.written_conf = written_step, written_conf
        self.sampled, self.conf = {}, {}
        for i in range(lo, hi):
            row = probs[i].clone()
            row[MASK] = -1.0
            self.sampled[i] = int(row.argmax())
            self.conf[i] = float(probs[i, self.sampled[i]])

    def masks(self) -> list[int]:
        return [i for i in range(max(self.lo, self.prompt_len), self.hi) if self.canvas[i] == MASK]

    def written(self) -> list[int]:
        return [i for i in range(max(self.lo, self.prompt_len), self.hi) if self.canvas[i] != MASK]

    def p_now(self, i: int) -> float:
        return float(self.probs[i, self.canvas[i]])


def reference_decode(fn, prompt: list[int], gen_length: int, block: int,
                     commit: Callable[[View], list[int]], remask: Callable[[View, list[int]], list[int]] | None = None):
    n_blocks = -(-(len(prompt) + gen_length) // block)
    canvas = list(prompt) + [MASK] * (n_blocks * block - len(prompt))
    written_step: dict[int, int] = {}
    written_conf: dict[int, float] = {}
    nfe = remasks = 0
    for b in range(len(prompt) // block, n_blocks):
        lo, hi = b * block, (b + 1) * block
        start = sum(1 for i in range(max(lo, len(prompt)), hi) if canvas[i] == MASK)
        block_step = 0
        while any(canvas[i] == MASK for i in range(max(lo, len(prompt)), hi)):
            ids = torch.tensor([canvas[:hi]])
            pos = torch.arange(hi)
            attn = (pos[None, :] // block <= pos[:, None] // block)[None]
            probs = torch.softmax(fn(ids, pos[None], attn)[0].double(), -1)
            view = View(probs, canvas, lo, hi, len(prompt), nfe, block_step, start, written_step, written_conf)
            chosen = commit(view)
            assert chosen and all(canvas[i] == MASK for i in chosen)
            gone = remask(view, chosen) if remask else []
            for i in chosen:
                canvas[i] = view.sampled[i]
                written_step[i], written_conf[i] = nfe, view.conf[i]
            remasks += len(gone)
            for i in gone:
                canvas[i] = MASK
                written_step.pop(i), written_conf.pop(i)
            nfe += 1
            block_step += 1
    return canvas, nfe, remasks


def best(view: View, candidates: list[int], key) -> list[int]:
    """The candidate with the largest key (the lowest position on ties)."""
    return [max(candidates, key=lambda i: (key(i), -i))]


def ref_threshold(tau: float):
    def commit(view: View) -> list[int]:
        masks = view.masks()
        return [i for i in masks if view.conf[i] > tau] or best(view, masks, view.conf.get)
    return commit


def ref_low_confidence(tau: float):
    def remask(view: View, chosen: list[int]) -> list[int]:
        weak = sorted((view.p_now(i), i) for i in view.written() if view.p_now(i) < tau)
        return [i for _, i in weak[: max(len(chosen) - 1, 0)]]
    return remask


def ref_dus(base: int):
    def group(offset: int, n: int) -> int:
        k = 0
        while base**k < n:
            k += 1
        if offset == 0:
            return 0
        v = 0
        while offset % base == 0:
            offset //= base
            v += 1
        return max(0, k - 1 - v)

    def commit(view: View) -> list[int]:
        first = max(view.lo, view.prompt_len)
        n = view.hi - first
        masks = view.masks()
        due = [i for i in masks if group(i - first, n) <= view.block_step]
        return due or best(view, masks, lambda i: view.conf[i] - 2 * group(i - first, n))
    return commit


def ref_quota(view: View, steps: int) -> int:
    m, s = view.masks_at_start, min(view.block_step + 1, steps)
    target = s * (m // steps) + min(s, m % steps)
    left = len(view.masks())
    return min(max(target - (m - left), 1), left)


def ref_pc(lam: float, eps: float, steps: int):
    def commit(view: View) -> list[int]:
        first = max(view.lo, view.prompt_len)
        p_bg = view.probs[view.lo: view.hi].mean(0)
        score = {i: math.exp(-lam * (i - first)) * -view.conf[i] * math.log(max(float(p_bg[view.sampled[i]]), eps))
                 for i in view.masks()}
        ranked = sorted(score, key=lambda i: (-score[i], i))
        return sorted(ranked[: ref_quota(view, steps)])
    return commit


def ref_t2m(drop: float, floor: float, min_age: int):
    def remask(view: View, chosen: list[int]) -> list[int]:
        hits = []
        for i in view.written():
            if i not in view.written_step:
                continue
            now, then = view.p_now(i), view.written_conf[i]
            if view.step - view.written_step[i] >= min_age and now < drop * then and now < floor:
                hits.append((now / then, i))
        return [i for _, i in sorted(hits)[: max(len(chosen) - 1, 0)]]
    return remask


CASES = {
    "wino": ({"m2t": {"name": "wino"}, "remask": {"name": "wino"}}, ref_threshold(0.6), ref_low_confidence(0.9)),
    "wino_tuned": ({"m2t": {"name": "wino", "params": {"threshold": 0.4}}, "remask": {"name": "wino", "params": {"threshold": 0.7}}},
                   ref_threshold(0.4), ref_low_confidence(0.7)),
    "dus": ({"m2t": {"name": "dus"}}, ref_dus(2), None),
    "dus_base3": ({"m2t": {"name": "dus", "params": {"base": 3}}}, ref_dus(3), None),
    "pc_sampler": ({"m2t": {"name": "pc_sampler", "params": {"steps_per_block": 3}}}, ref_pc(0.25, 1e-3, 3), None),
    "pc_sampler_flat": ({"m2t": {"name": "pc_sampler", "params": {"steps_per_block": 4, "lam": 0.0, "epsilon": 0.05}}},
                        ref_pc(0.0, 0.05, 4), None),
    "t2m": ({"m2t": {"name": "threshold", "params": {"threshold": 0.3}}, "remask": {"name": "t2m", "params": {"drop": 0.9, "floor": 0.6}}},
            ref_threshold(0.3), ref_t2m(0.9, 0.6, 1)),
}


def random_problem(seed: int) -> tuple[Callable, list[int], int]:
    """(logits function, prompt, generation length) of one reference comparison: a mixing model, where
    written tokens sway their neighbours, a prompt of 1-11 tokens, 6-20 tokens to generate."""
    rng = random.Random(seed)
    fn = mixing_logits(VOCAB, seed=seed, scale=0.5, mix=4.0)
    return fn, [rng.randrange(0, EOS) for _ in range(rng.randint(1, 11))], rng.randint(6, 20)


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_matches_the_plain_loop_reference(name):
    roles, commit, remask = CASES[name]
    block = 8
    policy = {"t2t": {"name": "none"}, "remask": {"name": "none"}, **roles,
              "blocks": {"name": "semi_ar", "params": {"block_length": block, "max_post_steps": 0, "eos_early_stop": False}}}
    extra = remasked = 0
    for seed in range(4):
        fn, prompt, gen = random_problem(seed)
        canvas, nfe, n_remasks = reference_decode(fn, prompt, gen, block, commit, remask)
        res = decode(ScriptedLM(fn, VOCAB, MASK, EOS), [prompt], policy, gen, seed=seed)
        assert res.canvas[0].tolist() == canvas, f"{name} seed {seed}: tokens differ from the reference loop"
        assert res.rows[0].nfe == nfe, f"{name} seed {seed}: NFE {res.rows[0].nfe}, reference {nfe}"
        extra += nfe - (-(-(len(prompt) + gen) // block) - len(prompt) // block)  # forwards beyond one per block
        remasked += n_remasks
    assert extra > 0  # several forwards per block: the commit rule decides something
    assert remasked > 0 or "remask" not in roles  # and the remask rule does remask


# -- the catalogue sweep ---------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def catalogue_yaml() -> dict:
    import yaml

    return yaml.safe_load((REPO / "experiments" / "catalogue.yaml").read_text())


def test_catalogue_sweep_offers_every_builtin_rule():
    from dlm_toolkit.strategy.registry import REGISTRIES

    space = catalogue_yaml()["search_space"]
    for role in ("m2t", "t2t", "remask"):
        builtin = {e.name for e in REGISTRIES[role].entries() if e.source == "built-in"}
        builtin -= {"reference"}  # needs an oracle model's joint: experiments/oracle.yaml offers it
        offered = set(space[f"{role}.name"]["categorical"])
        assert builtin == offered, f"experiments/catalogue.yaml {role}.name: missing {sorted(builtin - offered)}"


def test_every_rule_combination_the_catalogue_space_allows_builds_a_policy():
    """No trial of the catalogue sweep can draw a pairing the policy refuses (s2d2 or wino_shadow with a
    dynamic block schedule): every combination of the role names its conditions allow is built."""
    import itertools

    from dlm_toolkit.sweep.space import ParamSpec

    space = catalogue_yaml()["search_space"]
    names = [k for k in space if k.endswith(".name")]
    built = 0
    for combo in itertools.product(*(space[k]["categorical"] for k in names)):
        values = dict(zip(names, combo))
        active = {k: v for k, v in values.items() if ParamSpec.model_validate(space[k]).active(values)}
        DecodingPolicy("llada2.1-q", **active)
        built += 1
    assert built > 500


def test_catalogue_sweep_runs(tmp_path):
    import sweep_helpers as h
    from optuna import load_study
    from optuna.trial import TrialState

    from dlm_toolkit.sweep.experiment import load_experiment
    from dlm_toolkit.sweep.study import run_sweep

    data = {**catalogue_yaml(), "n": 4, "batch_size": 4, "sampler": {"name": "random", "seed": 3},
            "presets_to_enqueue": [], "model": str(REPO / "checkpoints" / "testbed-v2-editable")}
    exp = load_experiment(data, base_dir=REPO / "experiments")  # the file's ranges lie inside every rule's
    storage = f"sqlite:///{tmp_path}/optuna.db"
    result = run_sweep(exp, 4, storage=storage, tracking_uri=h.tracking_uri(tmp_path), progress=False,
                       heartbeat_interval=2, threads=1)
    trials = load_study(study_name="catalogue", storage=storage).get_trials()
    assert result.complete and [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert len({t.params["m2t.name"] for t in trials}) > 1  # the roles' rules are searched


# -- the comparison table --------------------------------------------------------------------------


def load_catalogue_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("catalogue_script", REPO / "experiments" / "catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through the module
    spec.loader.exec_module(module)
    return module


def records(scores: list[int], tokens: int, nfe: int) -> list[dict]:
    return [{"score": s, "tokens": tokens, "nfe": nfe} for s in scores]


def test_claim_verdicts():
    from dlm_toolkit.evaluation.stats import compare_outcomes

    cat = load_catalogue_script()
    base = records([0] * 15 + [1] * 5, tokens=10, nfe=5)
    better = records([1] * 20, tokens=10, nfe=5)  # 15 more right (McNemar p ~ 6e-5), same speed
    faster = records([0] * 15 + [1] * 5, tokens=10, nfe=2)
    worse_faster = records([0] * 20, tokens=10, nfe=2)
    slower_better = records([1] * 20, tokens=10, nfe=10)
    same = records([0] * 15 + [1] * 5, tokens=10, nfe=5)
    cases = [(better, "better", "holds"), (faster, "faster", "holds"), (same, "better", "inconclusive"),
             (same, "faster", "inconclusive"), (worse_faster, "faster", "holds"),  # 5 lost: p = 0.06, not significant
             (slower_better, "better", "inconclusive"), (faster, "better", "inconclusive"),
             (records([0] * 20, tokens=10, nfe=5), "better", "inconclusive"),
             (records([0] * 13 + [1] * 7, tokens=10, nfe=5), "better", "inconclusive"),  # +2 right: p = 0.5
             (records([1] * 20, tokens=10, nfe=5.25), "better", "holds")]  # 5 % slower is still "equal speed"
    for b, direction, want in cases:
        assert cat.verdict(compare_outcomes(base, b, n_boot=300), direction) == want, (direction, want)
    lost = records([1] * 20, tokens=10, nfe=5)
    assert cat.verdict(compare_outcomes(lost, records([0] * 20, tokens=10, nfe=2), n_boot=300), "faster") == "fails"
    assert cat.verdict(compare_outcomes(lost, records([0] * 20, tokens=10, nfe=5), n_boot=300), "better") == "fails"


def test_catalogue_table_at_small_size(tmp_path, capsys):
    cat = load_catalogue_script()
    policies = ["Q", "S", "DUS", "top-k, 5 steps", "WINO"]
    assert cat.main([str(REPO / "checkpoints" / "testbed-v2-editable"), "--n", "6", "--tasks", "pick", "--policies",
                     *policies, "--n-boot", "200", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "catalogue.json").read_text())
    rows = {r["policy"]: r for r in result["tasks"]["pick"]["rows"]}
    assert list(rows) == policies
    for r in rows.values():
        assert f"| {r['policy']} | {r['accuracy']:.3f}" in printed
        k = round(r["accuracy"] * 6)  # the Wilson interval by its formula
        z, p = 1.959963984540054, k / 6
        centre, half = (p + z * z / 12) / (1 + z * z / 6), z / (1 + z * z / 6) * math.sqrt(p * (1 - p) / 6 + z * z / 144)
        assert r["interval"] == pytest.approx([max(0.0, centre - half), min(1.0, centre + half)], abs=1e-9)
        for ref in ("Q", "S"):
            assert set(r["vs"]) == {"Q", "S"} - {r["policy"]}
            if ref != r["policy"]:
                assert r["vs"][ref]["accuracy_diff"] == pytest.approx(r["accuracy"] - rows[ref]["accuracy"])
    assert rows["DUS"]["nfe"] < rows["Q"]["nfe"] and rows["WINO"]["remasks"] > 0
    claims = {c["strategy"]: c for c in result["tasks"]["pick"]["claims"]}
    assert set(claims) == {"WINO", "DUS"} and claims["DUS"]["baseline"] == "top-k, 5 steps"
    assert (tmp_path / "catalogue.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "catalogue.md").read_text() in printed
    (tmp_path / "catalogue.png").unlink()  # --redraw: table and chart again from the JSON alone
    assert cat.main(["unused", "--out", str(tmp_path), "--redraw"]) == 0
    assert (tmp_path / "catalogue.png").is_file() and (tmp_path / "catalogue.md").read_text() in printed



def test_catalogue_files_are_replaced_all_or_nothing(tmp_path, monkeypatch):
    """A chart that fails leaves the previous table in place and no temporary file behind."""
    cat = load_catalogue_script()
    result = {"n": 1, "seed": 0, "tasks": {}}
    (tmp_path / "catalogue.json").write_text(json.dumps(result))
    (tmp_path / "catalogue.md").write_text("previous table")

    def broken_chart(result, path):
        raise RuntimeError("no chart")

    monkeypatch.setattr(cat, "chart", broken_chart)
    with pytest.raises(RuntimeError, match="no chart"):
        cat.main(["unused", "--out", str(tmp_path), "--redraw"])
    assert (tmp_path / "catalogue.md").read_text() == "previous table"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["catalogue.json", "catalogue.md"]


# -- learned policy --------------------------------------------------------------------------------


def write_net(folder: Path, net: dict, config: dict | None = None, name: str = "net") -> Path:
    from safetensors.torch import save_file

    from strategies.m2t_learned import FEATURES

    path = folder / f"{name}.safetensors"
    save_file({k: torch.tensor(v, dtype=torch.float32) for k, v in net.items()}, str(path))
    hidden = len(net["b1"])
    config = config if config is not None else {"format": "dlm-learned-policy", "version": 1, "features": list(FEATURES), "hidden": hidden}
    path.with_suffix(".json").write_text(json.dumps(config))
    return path


def confidence_net(cut: float) -> dict:
    """score = relu(confidence) - cut: commit iff confidence > cut, the threshold rule."""
    return {"w1": [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]], "b1": [0.0], "w2": [[1.0]], "b2": [-cut]}


def test_learned_features_by_hand():
    from strategies.m2t_learned import features

    # prompt 1 position, block of 5 generated positions, 2 of them written; block step 3
    tokens = torch.tensor([[1, M, 4, M, 5, M]])
    logits = conf((0.9, 1), (0.7, 2), (0.9, 4), (0.5, 3), (0.9, 5), (0.96, 6))
    ctx = make_context(tokens, logits, mask_token_id=M, prompt_len=1, block_step=3)
    f = features(ctx)[0]
    p = ctx.probs[0].double()
    for i in (1, 3, 5):
        top = p[i].sort(descending=True).values
        want = [p[i].max().item(), (top[0] - top[1]).item(), -(p[i][p[i] > 0] * p[i][p[i] > 0].log()).sum().item(),
                (i - 1) / 5, 3 / 5, 3 / 5]
        assert f[i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_learned_rule_with_a_confidence_network_is_the_threshold_rule(tmp_path):
    from dlm_toolkit.testing.contracts import build_context, random_case

    path = write_net(tmp_path, confidence_net(0.8))
    learned, threshold = M2T.get("learned")(path=str(path)), M2T.get("threshold")(threshold=0.8)
    for seed in range(30):
        ctx = build_context(random_case(seed), seed=seed)
        assert torch.equal(learned(ctx), threshold(ctx)), seed
    # the threshold applies to sigmoid(score): t moves the cut to confidence > 0.8 + logit(t)
    ctx = make_context(torch.full((1, 3), M), conf((0.9, 1), (0.85, 2), (0.6, 3)), mask_token_id=M)
    assert selected(M2T.get("learned")(path=str(path), threshold=0.5)(ctx)) == [0, 1]
    assert 0.85 - 0.8 < math.log(0.52 / 0.48) < 0.9 - 0.8 and selected(M2T.get("learned")(path=str(path), threshold=0.52)(ctx)) == [0]


def test_learned_score_is_the_mlp():
    from strategies.m2t_learned import score

    gen = torch.Generator().manual_seed(0)
    net = {"w1": torch.randn(3, 6, generator=gen), "b1": torch.randn(3, generator=gen),
           "w2": torch.randn(1, 3, generator=gen), "b2": torch.randn(1, generator=gen)}
    x = torch.randn(5, 6, generator=gen)
    for row, got in zip(x.tolist(), score(net, x).tolist()):
        hidden = [max(0.0, sum(w * v for w, v in zip(net["w1"][h].tolist(), row)) + net["b1"][h].item()) for h in range(3)]
        want = sum(w * v for w, v in zip(net["w2"][0].tolist(), hidden)) + net["b2"].item()
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_learned_rule_refuses_bad_files(tmp_path):
    from dlm_toolkit.config import ConfigError
    from strategies.m2t_learned import FEATURES

    rule = M2T.get("learned")
    good = confidence_net(0.5)
    bad = {
        "missing": tmp_path / "nope.safetensors",
        "pickle": tmp_path / "pickled.safetensors",
        "torch.save": tmp_path / "saved.safetensors",
        "wrong shape": write_net(tmp_path, {**good, "w1": [[1.0, 0.0, 0.0]]}, name="shape"),
        "wrong features": write_net(tmp_path, good, {"format": "dlm-learned-policy", "version": 1,
                                                     "features": list(FEATURES)[::-1], "hidden": 1}, name="features"),
        "no config": write_net(tmp_path, good, name="noconfig"),
        "not safetensors": tmp_path / "text.safetensors",
        "too large": tmp_path / "large.safetensors",
    }
    with bad["too large"].open("wb") as f:
        f.truncate((8 << 20) + 1)
    import pickle

    bad["pickle"].write_bytes(pickle.dumps({"w1": [[1.0]]}))
    torch.save({"w1": torch.ones(1, 6)}, bad["torch.save"])
    bad["no config"].with_suffix(".json").unlink()
    bad["not safetensors"].write_text("hello, world")
    said = {"missing": "no such file", "pickle": "pickle", "torch.save": "pickle", "wrong shape": "expected",
            "wrong features": "features", "no config": "JSON config", "not safetensors": "not a safetensors file",
            "too large": "more than the"}
    for what, path in bad.items():
        with pytest.raises(ConfigError) as err:
            rule(path=str(path))
        message = str(err.value)
        assert "m2t 'learned'" in message and said[what] in message and "\n" not in message.strip(), (what, message)


def test_learned_recipe_fits_and_the_rule_decodes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("learned_recipe", REPO / "experiments" / "train" / "learned_policy.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "pick.safetensors"
    ckpt = str(REPO / "checkpoints" / "testbed-v2-editable")
    assert recipe.main([ckpt, "--task", "pick", "--n", "8", "--steps", "30", "--out", str(out)]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["examples"] > meta["positives"] > 0 and meta["hidden"] == 16
    from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
    from dlm_toolkit.strategy.policy_config import load_policy

    model, tok = load_checkpoint(ckpt)
    res = evaluate(model, tok, "pick", load_policy("llada2.1-q", {"m2t.name": "learned", "m2t.params.path": str(out)}), 4,
                   progress=False, threads=1)
    assert res.metrics["n"] == 4 and res.metrics["nfe_mean"] >= 1
