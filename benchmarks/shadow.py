"""What WINO's shadow block costs: WINO narrow-out on the visible token (``remask: wino``) against the
paper's shadow block (``remask: wino_shadow``), on the testbed-v2 tasks, Q thresholds otherwise.

Run: ``OMP_NUM_THREADS=1 python benchmarks/shadow.py [--checkpoint checkpoints/testbed-v2-editable] [--n 200] [--json]``.
The shadow adds no forward (NFE shows the steps) but a block of positions to every forward:
``forward_tokens_per_token`` shows that compute, ``tokens_per_second`` (best of ``--repeats``, one
thread) what it costs on this machine.
"""

from __future__ import annotations

import argparse
import json

import torch

from dlm_toolkit import DecodingPolicy
from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint

VARIANTS = {"wino": "visible token", "wino_shadow": "shadow block"}
KEYS = ("accuracy", "tpf", "nfe_mean", "remasks_per_token", "forward_tokens_per_token", "tokens_per_second")


def shadow_table(checkpoint: str, tasks: list[str], n: int, repeats: int = 2, seed: int = 0) -> list[dict]:
    """One row per (task, narrow-out variant): the metrics of the run with the best tokens/s."""
    torch.set_num_threads(1)
    model, tok = load_checkpoint(checkpoint)
    rows = []
    for task in tasks:
        for remask, label in VARIANTS.items():
            policy = DecodingPolicy("llada2.1-q", **{"m2t.name": "wino", "remask.name": remask})
            runs = [evaluate(model, tok, task, policy, n, seed, batch_size=50, progress=False).metrics
                    for _ in range(repeats)]
            best = max(runs, key=lambda m: m["tokens_per_second"])
            rows.append({"task": task, "narrow_out": label, **{k: best[k] for k in KEYS}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/testbed-v2-editable")
    parser.add_argument("--tasks", default="pick,either,tiesort")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = shadow_table(args.checkpoint, args.tasks.split(","), args.n, args.repeats)
    if args.json:
        print(json.dumps(rows))
        return
    print("| task | narrow-out on | accuracy | TPF | NFE mean | remasks/token | forward tokens/token | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['narrow_out']} | {r['accuracy']:.3f} | {r['tpf']:.2f} | {r['nfe_mean']:.1f} | "
              f"{r['remasks_per_token']:.3f} | {r['forward_tokens_per_token']:.1f} | {r['tokens_per_second']:.0f} |")


if __name__ == "__main__":
    main()
