"""Statistics against published and hand-computed values, and the commands that report them."""

from __future__ import annotations

import json
import math

import pytest

from dlm_toolkit.cli import main
from dlm_toolkit.evaluation.stats import compare_outcomes, mcnemar_exact, paired_bootstrap, wilson

CHECKPOINT = "checkpoints/testbed-editable"


@pytest.mark.parametrize("k,n,low,high", [  # Newcombe (1998), Stat Med 17:857, Table I, method 3 (score)
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
])
def test_wilson_matches_newcombe(k, n, low, high):
    lo, hi = wilson(k, n)
    assert round(lo, 4) == low and round(hi, 4) == high


def test_wilson_edges_and_bad_input():
    assert wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(10, 10)
    assert math.isclose(hi, 1.0) and round(lo, 4) == 0.7225  # n / (n + z^2) with z = 1.96
    for n in (3, 300, 2000):  # the ends hold p exactly at p = 0 and 1 (error bars p - lo, hi - p never negative)
        assert wilson(n, n)[1] == 1.0 and wilson(0, n)[0] == 0.0
    with pytest.raises(ValueError):
        wilson(5, 4)


@pytest.mark.parametrize("only_a,only_b,p", [
    (1, 9, 2 * 11 / 1024),          # 2 * (C(10,0) + C(10,1)) / 2^10
    (0, 6, 2 / 64),                 # 2 * 1 / 2^6
    (3, 3, 1.0),                    # tail past one half: capped
    (0, 0, 1.0),                    # no discordant pair: no evidence
    (2, 10, 2 * (1 + 12 + 66) / 4096),
])
def test_mcnemar_exact_by_hand(only_a, only_b, p):
    assert math.isclose(mcnemar_exact(only_a, only_b), p)
    assert math.isclose(mcnemar_exact(only_b, only_a), p)  # symmetric


def test_paired_bootstrap_of_a_constant_shift_is_exact():
    a = [(float(i % 7),) for i in range(40)]
    b = [(x + 0.25,) for (x,) in a]
    mean = lambda rows: sum(r[0] for r in rows) / len(rows)  # noqa: E731
    diff, lo, hi = paired_bootstrap(a, b, mean, n_boot=300)
    assert math.isclose(diff, 0.25) and math.isclose(lo, 0.25) and math.isclose(hi, 0.25)
    assert paired_bootstrap(a, b, mean, n_boot=300, seed=4) == paired_bootstrap(a, b, mean, n_boot=300, seed=4)
    with pytest.raises(ValueError):
        paired_bootstrap(a, b[:-1], mean)


def test_compare_outcomes_counts_discordant_pairs_and_ratio_tpf():
    a = [{"score": 1, "tokens": 10, "nfe": 5}] * 30 + [{"score": 0, "tokens": 10, "nfe": 5}] * 10
    b = [{"score": 1, "tokens": 10, "nfe": 2}] * 20 + [{"score": 0, "tokens": 10, "nfe": 2}] * 20
    c = compare_outcomes(a, b, n_boot=500)
    assert (c.only_a, c.only_b) == (10, 0)
    assert math.isclose(c.mcnemar_p, 2 / 1024) and c.accuracy_differs
    assert math.isclose(c.accuracy_diff, 20 / 40 - 30 / 40)
    assert c.accuracy_diff_interval[1] < 0
    assert math.isclose(c.tpf_a, 2.0) and math.isclose(c.tpf_b, 5.0) and c.tpf_differs
    same = compare_outcomes(a, a, n_boot=200)
    assert same.mcnemar_p == 1.0 and same.accuracy_diff_interval == (0.0, 0.0) and not same.tpf_differs


def test_eval_json_reports_the_interval_and_every_instance(capsys):
    assert main(["eval", "--checkpoint", CHECKPOINT, "--task", "sort", "--n", "12", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    lo, hi = wilson(sum(i["score"] for i in out["instances"]), 12)
    assert out["accuracy_interval"] == [lo, hi] and lo <= out["accuracy"] <= hi
    assert len(out["instances"]) == 12 and {"score", "nfe", "tokens", "edits"} <= set(out["instances"][0])
    assert math.isclose(out["tpf"], sum(i["tokens"] for i in out["instances"]) / sum(i["nfe"] for i in out["instances"]))


def test_compare_json_pairs_the_same_instances(capsys):
    args = ["compare", "--checkpoint", CHECKPOINT, "--task", "sort", "--n", "16", "--json", "--no-progress",
            "--n-boot", "200", "--set-b", "t2t.name=none"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    paired = out["paired"]
    assert paired["n"] == 16 and paired["accuracy_a"] == out["a"]["accuracy"] and paired["accuracy_b"] == out["b"]["accuracy"]
    assert math.isclose(paired["tpf_a"], out["a"]["tpf"]) and math.isclose(paired["tpf_b"], out["b"]["tpf"])
    assert out["a"]["policy_hash"] != out["b"]["policy_hash"]
    assert main([*args[:-2], "--set-b", "m2t.params.threshold=0.7", "--set-b", "t2t.params.threshold=0.5"]) == 0
    same = json.loads(capsys.readouterr().out)["paired"]  # B set to Q's thresholds: the same decodes
    assert same["accuracy_diff"] == 0 and same["tpf_diff"] == 0 and same["mcnemar_p"] == 1.0


def test_compare_names_the_overrides_that_make_the_policies_differ(capsys):
    assert main(["compare", "--checkpoint", CHECKPOINT, "--task", "sort", "--n", "4", "--no-progress", "--n-boot", "100",
                 "--a", "llada2.1-s", "--b", "llada2.1-s", "--set-b", "t2t.name=none",
                 "--set-b", "m2t.params.threshold=0.6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    a = next(line for line in lines if line.startswith("  A "))
    b = next(line for line in lines if line.startswith("  B "))
    assert a.split()[1:3] == ["llada2.1-s", "accuracy"]
    assert b.split()[1:7] == ["llada2.1-s", "+", "t2t.name=none", "+", "m2t.params.threshold=0.6", "accuracy"]


@pytest.mark.parametrize("args,needle", [
    (["eval", "--task", "humaneval", "--n", "165"], "164 eval instances"),
    (["compare", "--task", "humaneval", "--n", "500"], "164 eval instances"),
    (["compare", "--task", "nope", "--n", "5"], "unknown task"),
    (["compare", "--task", "sort", "--n", "5", "--n-boot", "3"], "--n-boot"),
    (["compare", "--task", "sort", "--n", "5", "--set-a", "m2t.params.threshold=7"], "threshold"),
])
def test_bad_input_one_line_exit_2(args, needle, capsys):
    assert main([*args, "--checkpoint", CHECKPOINT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
