"""Multi-block editing (MBE) on the testbed: accuracy, TPF and compute with k = 0, 1, 2 (S mode).

Run: ``python benchmarks/mbe.py [--checkpoint checkpoints/testbed-editable] [--n 200] [--json]``.
MBE widens the edit window to the active block plus ``k`` earlier blocks (forwarded together,
bidirectionally); ``k = 0`` is plain ``semi_ar``. NFE shows extra post steps; the extra compute of
re-forwarding earlier blocks shows in ``forward_tokens_per_token``.
"""

from __future__ import annotations

import argparse
import json

from dlm_toolkit import DecodingPolicy
from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint


def mbe_table(checkpoint: str, tasks: list[str], n: int, block_length: int, seed: int = 0) -> list[dict]:
    model, tok = load_checkpoint(checkpoint)
    rows = []
    for task in tasks:
        for k in (0, 1, 2):
            policy = DecodingPolicy("llada2.1-s", **{
                "blocks.name": "multi_block_edit", "blocks.params.edit_blocks": k,
                "blocks.params.block_length": block_length,
            })
            m = evaluate(model, tok, task, policy, n, seed, progress=False).metrics
            rows.append({"task": task, "k": k, **{key: m[key] for key in (
                "accuracy", "tpf", "nfe_mean", "edits_per_token", "forward_tokens_per_token", "tokens_per_second")}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/testbed-editable")
    parser.add_argument("--tasks", default="add,sort")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--block-length", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = mbe_table(args.checkpoint, args.tasks.split(","), args.n, args.block_length)
    if args.json:
        print(json.dumps(rows))
        return
    print("| task | k | accuracy | TPF | NFE mean | edits/token | forward tokens/token | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['task']} | {r['k']} | {r['accuracy']:.3f} | {r['tpf']:.2f} | {r['nfe_mean']:.1f} | "
              f"{r['edits_per_token']:.3f} | {r['forward_tokens_per_token']:.1f} | {r['tokens_per_second']:.0f} |")


if __name__ == "__main__":
    main()
