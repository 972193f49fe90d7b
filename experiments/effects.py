"""How remasking and multi-block editing move the S and Q presets, with paired intervals.

    python experiments/effects.py checkpoints/testbed-v2-editable --tasks either tiesort --n 500

For each task and base preset, the base policy and each variant decode the same ``n`` eval instances
(seed 0, so the same per-instance random streams); the table gives the variant minus the base:
accuracy difference with its paired-bootstrap 95 % interval and exact McNemar p, TPF difference with
its interval, and the variant's remasks and edits per generated token. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time

from dlm_toolkit.strategy.policy_config import load_policy
from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
from dlm_toolkit.evaluation.stats import compare_outcomes

VARIANTS = {
    "remask low_confidence": {"remask.name": "low_confidence"},
    "remask remdm": {"remask.name": "remdm"},
    "multi_block_edit (2 blocks)": {"blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 2},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--tasks", nargs="+", default=["either", "tiesort"])
    ap.add_argument("--presets", nargs="+", default=["llada2.1-s", "llada2.1-q"])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, tok = load_checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    print(f"`python experiments/effects.py {args.checkpoint} --tasks {' '.join(args.tasks)} --n {args.n}` "
          f"(seed {args.seed}, 1 thread); variant minus base, 95 % paired intervals\n")
    print("| task | base | variant | base acc | variant acc | accuracy diff | McNemar p | TPF diff | remasks/token | edits/token |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for task in args.tasks:
        for preset in args.presets:
            base = evaluate(model, tok, task, load_policy(preset), args.n, args.seed, progress=False, threads=1)
            for label, sets in VARIANTS.items():
                var = evaluate(model, tok, task, load_policy(preset, sets), args.n, args.seed, progress=False, threads=1)
                c = compare_outcomes(base.records, var.records, seed=args.seed)
                (alo, ahi), (tlo, thi) = c.accuracy_diff_interval, c.tpf_diff_interval
                print(f"| {task} | {preset} | {label} | {base.metrics['accuracy']:.3f} | {var.metrics['accuracy']:.3f} | "
                      f"{c.accuracy_diff:+.3f} [{alo:+.3f}, {ahi:+.3f}] | {c.mcnemar_p:.3g} | "
                      f"{c.tpf_diff:+.2f} [{tlo:+.2f}, {thi:+.2f}] | {var.metrics['remasks_per_token']:.4f} | "
                      f"{var.metrics['edits_per_token']:.3f} |", flush=True)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
