"""Measure the model-card table of a trained checkpoint and write ``evaluation.json``.

    python experiments/train/evaluate_card.py checkpoints/testbed-editable [--n 200] [--tasks add sort sudoku]

For each preset (llada2.1-q, llada2.1-s, llada2.1-s with ``t2t.name=none``, llada2.0) and task it
runs ``dlm_toolkit.evaluation.evaluate.evaluate`` on ``n`` held-out instances (``--seed``, default 0) and records accuracy,
TPF (generated tokens up to and including the first EOS, per forward), mean NFE and edits per
token. Prints the markdown table that goes into the model card; with ``--card`` it also writes the
table and the derived target lines (editing gain, S/Q TPF ratio) into CHECKPOINT/README.md, between
the lines ``<!-- evaluation:start -->`` and ``<!-- evaluation:end -->``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
from dlm_toolkit.decoding.policy import DecodingPolicy

PRESETS = {
    "llada2.1-q": ("llada2.1-q", {}),
    "llada2.1-s": ("llada2.1-s", {}),
    "llada2.1-s+t2t.name=none": ("llada2.1-s", {"t2t.name": "none"}),
    "llada2.0": ("llada2.0", {}),
}


def markdown(results: dict) -> str:
    lines = ["| preset | task | accuracy | TPF | NFE mean | edits/token |", "|---|---|---|---|---|---|"]
    for preset, per_task in results.items():
        for task, m in per_task.items():
            lines.append(f"| {preset} | {task} | {m['accuracy']:.3f} | {m['tpf']:.2f} | {m['nfe_mean']:.1f} | "
                         f"{m['edits_per_token']:.3f} |")
    return "\n".join(lines)


def derived(results: dict) -> str:
    """The numbers the issue's targets are stated in, computed from the table."""
    lines = []
    q, s, none = (results.get(k, {}) for k in ("llada2.1-q", "llada2.1-s", "llada2.1-s+t2t.name=none"))
    for task in sorted(set(q) | set(s)):
        if task in s and task in none:
            gain = 100 * (s[task]["accuracy"] - none[task]["accuracy"])
            lines.append(f"- editing at S mode (edit threshold 0.0 vs `t2t.name=none`), `{task}`: {gain:+.1f} points")
            if task in q:
                loss = 100 * (q[task]["accuracy"] - none[task]["accuracy"])
                share = f" = {gain / loss:.0%} of it" if loss > 0 else ""
                lines.append(f"- S mode without editing vs Q, `{task}`: {-loss:+.1f} points; editing wins back "
                             f"{gain:+.1f}{share}")
        if task in s and task in q and q[task]["tpf"] > 0:
            lines.append(f"- S-mode TPF / Q-mode TPF, `{task}`: {s[task]['tpf'] / q[task]['tpf']:.2f}x")
    return "\n".join(lines)


def write_card(card: Path, block: str) -> None:
    text = card.read_text()
    pattern = re.compile(r"(<!-- evaluation:start -->\n).*?(<!-- evaluation:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"{card}: no '<!-- evaluation:start -->' ... '<!-- evaluation:end -->' lines to fill")
    card.write_text(pattern.sub(lambda m: m.group(1) + block + "\n" + m.group(2), text))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="eval seed (the cards use 0; pick another for a held-out check)")
    ap.add_argument("--tasks", nargs="+", default=["add", "sort", "sudoku"])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="JSON output (default: CHECKPOINT/evaluation.json)")
    ap.add_argument("--card", action="store_true", help="fill the evaluation block of CHECKPOINT/README.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_checkpoint(args.checkpoint)
    results: dict = {}
    t0 = time.perf_counter()
    for name in args.presets:
        preset, overrides = PRESETS[name]
        policy = DecodingPolicy(preset, **overrides)
        for task in args.tasks:
            res = evaluate(model, tok, task, policy, args.n, seed=args.seed, batch_size=args.batch_size,
                           progress=False)
            results.setdefault(name, {})[task] = {k: res.metrics[k] for k in
                                                  ("accuracy", "tpf", "nfe_mean", "edits_per_token", "wall_time_s")}
            print(f"{name:26s} {task:7s} " + "  ".join(f"{k} {v:.3f}" for k, v in results[name][task].items()),
                  flush=True)
    out = Path(args.out) if args.out else Path(args.checkpoint) / "evaluation.json"
    out.write_text(json.dumps({"n": args.n, "seed": args.seed, "results": results,
                               "eval_wall_time_s": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")
    block = markdown(results) + "\n\n" + derived(results)
    print(block)
    if args.card:
        write_card(Path(args.checkpoint) / "README.md", block)


if __name__ == "__main__":
    main()
