"""The catalogue comparison: every strategy combination of interest on the same testbed-v2 instances.

    python experiments/catalogue.py checkpoints/testbed-v2-editable --n 200 --out docs/catalogue

Each policy (a preset plus flat overrides, :data:`POLICIES`) decodes the same ``n`` eval instances of
each task (seed 0: the same per-instance random streams), 1 thread. Per task the table gives accuracy
with its 95 % Wilson interval, TPF, mean NFE, edits, remasks and inserts + deletes per generated token, and the paired
difference against Q and against S (``dlm compare``'s statistics, :func:`dlm_toolkit.evaluation.stats.compare_outcomes`:
accuracy difference with its paired-bootstrap interval and exact McNemar p, TPF difference with its
interval). A second table checks each paper's claimed direction (:data:`CLAIMS`) against the baseline
the paper compares with, and ``--out`` also writes ``catalogue.md``, ``catalogue.json`` and one
accuracy-vs-TPF chart, ``catalogue.png`` (one panel per task, Wilson bars).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dlm_toolkit.evaluation.evaluate import EvalResult, evaluate, load_checkpoint
from dlm_toolkit.util.files import atomic_write_many
from dlm_toolkit.strategy.policy_config import load_policy
from dlm_toolkit.evaluation.stats import PairedComparison, compare_outcomes

TASKS = ("pick", "either", "tiesort")

# label -> (preset, flat overrides). Q and S are the references every row is compared with; the
# top-k rows are the confidence planners DUS and PC-Sampler claim to beat at the same number of forwards.
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Q": ("llada2.1-q", {}),
    "S": ("llada2.1-s", {}),
    "WINO": ("llada2.1-q", {"m2t.name": "wino", "remask.name": "wino"}),
    "WINO, shadow block": ("llada2.1-q", {"m2t.name": "wino", "remask.name": "wino_shadow"}),
    "DUS": ("llada2.1-q", {"m2t.name": "dus"}),
    "top-k, 5 steps": ("llada2.1-q", {"m2t.name": "topk", "m2t.params.steps_per_block": 5}),
    "PC-Sampler, 8 steps": ("llada2.1-q", {"m2t.name": "pc_sampler", "m2t.params.steps_per_block": 8}),
    "top-k, 8 steps": ("llada2.1-q", {"m2t.name": "topk", "m2t.params.steps_per_block": 8}),
    "T2M": ("llada2.1-q", {"remask.name": "t2m"}),
    "Learned": ("llada2.1-q", {"m2t.name": "learned"}),
    "S2D2": ("llada2.1-q", {"m2t.name": "s2d2"}),
    "DSB": ("llada2.1-q", {"blocks.name": "dsb"}),
    # S plus insert/delete edits: a new t2t name starts from that rule's defaults, so S's substitution
    # threshold (0.0) is set again; the comparison with S then isolates the inserts and deletes
    "Indel": ("llada2.1-s", {"t2t.name": "indel", "t2t.params.threshold": 0.0}),
    # the same with repairs made readily (the defaults rarely fire on these fixed-length answers)
    "Indel, eager": ("llada2.1-s", {"t2t.name": "indel", "t2t.params.threshold": 0.0, "t2t.params.delete_threshold": 0.5,
                                    "t2t.params.insert_threshold": 0.5, "t2t.params.keep_below": 0.9}),
}
REFERENCES = ("Q", "S")


@dataclass(frozen=True)
class Claim:
    """A paper's claimed direction for ``strategy`` against ``baseline``: ``faster`` (higher TPF at
    equal accuracy) or ``better`` (higher accuracy at equal speed)."""

    strategy: str
    baseline: str
    direction: str
    paper: str


CLAIMS = (
    Claim("WINO", "Q", "faster", "WINO (2507.18578): 6x fewer forwards on GSM8K, +2.58 % accuracy"),
    Claim("WINO, shadow block", "Q", "faster", "WINO (2507.18578) as published, verified in the shadow block"),
    Claim("DUS", "top-k, 5 steps", "better", "DUS (2506.19037): beats confidence planners at the same forwards (log2 32 = 5)"),
    Claim("PC-Sampler, 8 steps", "top-k, 8 steps", "better", "PC-Sampler (2508.13021): beats confidence ranking at equal steps"),
    Claim("T2M", "Q", "better", "T2M (2604.18738): up to +5.92 on CMATH over LLaDA2.1"),
    Claim("Learned", "Q", "faster", "learned policy (2512.09106): fewer forwards than confidence heuristics at matched accuracy"),
    Claim("S2D2", "Q", "faster", "S2D2 (2603.25702): 4.4x faster than the static baseline on LLaDA2.1-mini, accuracy slightly higher"),
    Claim("DSB", "Q", "faster", "DSB (2602.05992): a sliding block of dynamic size decodes faster than fixed blocks at equal quality"),
    Claim("Indel", "S", "better", "insert/delete edits repair drafts that substitution cannot (LLaDA2.2; our Levenshtein-style rule)"),
)


def verdict(c: PairedComparison, direction: str) -> str:
    """``holds``, ``fails`` or ``inconclusive`` for a claim, from the paired comparison (baseline A, strategy B)."""
    worse_acc = c.accuracy_differs and c.accuracy_diff < 0
    if direction == "faster":
        if c.tpf_differs and c.tpf_diff > 0 and not worse_acc:
            return "holds"
        return "fails" if worse_acc or (c.tpf_differs and c.tpf_diff < 0) else "inconclusive"
    slower = c.tpf_differs and c.tpf_diff < 0 and c.tpf_diff < -0.1 * c.tpf_a  # "equal speed": within 10 %
    if c.accuracy_differs and c.accuracy_diff > 0 and not slower:
        return "holds"
    return "fails" if worse_acc else "inconclusive"


def run(model: Any, tokenizer: Any, tasks: Sequence[str], policies: Sequence[str], n: int, seed: int = 0,
        n_boot: int = 2000) -> dict[str, Any]:
    """Evaluate every policy on every task and compare; a JSON-ready dict of rows and claim checks."""
    out: dict[str, Any] = {"n": n, "seed": seed, "tasks": {}}
    for task in tasks:
        evals: dict[str, EvalResult] = {}
        for label in policies:
            preset, sets = POLICIES[label]
            evals[label] = evaluate(model, tokenizer, task, load_policy(preset, sets), n, seed, batch_size=50,
                                    progress=False, threads=1)
        rows = []
        for label, res in evals.items():
            m = res.metrics
            row = {"policy": label, "accuracy": m["accuracy"], "interval": list(res.accuracy_interval), "tpf": m["tpf"],
                   "nfe": m["nfe_mean"], "edits": m["edits_per_token"], "remasks": m["remasks_per_token"],
                   "indels": m["inserts_per_token"] + m["deletes_per_token"], "vs": {}}
            for ref in REFERENCES:
                if ref in evals and ref != label:
                    row["vs"][ref] = compare_outcomes(evals[ref].records, res.records, n_boot=n_boot, seed=seed).to_dict()
            rows.append(row)
        claims = []
        for claim in CLAIMS:
            if claim.strategy in evals and claim.baseline in evals:
                c = compare_outcomes(evals[claim.baseline].records, evals[claim.strategy].records, n_boot=n_boot, seed=seed)
                claims.append({**claim.__dict__, "verdict": verdict(c, claim.direction), "paired": c.to_dict()})
        out["tasks"][task] = {"rows": rows, "claims": claims}
    return out


def _diff(d: dict[str, Any] | None) -> str:
    if d is None:
        return "--"
    (lo, hi), (tlo, thi) = d["accuracy_diff_interval"], d["tpf_diff_interval"]
    return (f"{d['accuracy_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] p={d['mcnemar_p']:.2g}; "
            f"TPF {d['tpf_diff']:+.2f} [{tlo:+.2f}, {thi:+.2f}]")


def markdown(result: dict[str, Any]) -> str:
    """The comparison as Markdown: one table per task, then the claim checks."""
    lines = []
    for task, data in result["tasks"].items():
        lines += [f"**{task}** (n = {result['n']})", "",
                  "| policy | accuracy [95 % Wilson] | TPF | NFE | edits/token | remasks/token | ins+del/token | vs Q: accuracy, TPF | vs S: accuracy, TPF |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in data["rows"]:
            lo, hi = r["interval"]
            lines.append(f"| {r['policy']} | {r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] | {r['tpf']:.2f} | {r['nfe']:.1f} | "
                         f"{r['edits']:.3f} | {r['remasks']:.3f} | {r.get('indels', 0.0):.3f} | {_diff(r['vs'].get('Q'))} | {_diff(r['vs'].get('S'))} |")
        lines.append("")
    lines += ["| claim | task | strategy | baseline | direction | accuracy diff | TPF diff | holds here? |",
              "|---|---|---|---|---|---|---|---|"]
    for task, data in result["tasks"].items():
        for c in data["claims"]:
            p = c["paired"]
            lines.append(f"| {c['paper']} | {task} | {c['strategy']} | {c['baseline']} | {c['direction']} | "
                         f"{p['accuracy_diff']:+.3f} (p={p['mcnemar_p']:.2g}) | {p['tpf_diff']:+.2f} | {c['verdict']} |")
    return "\n".join(lines) + "\n"


def chart(result: dict[str, Any], path: Path) -> None:
    """One accuracy-vs-TPF figure, a panel per task, Wilson intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dlm_toolkit.evaluation.plots import place_labels

    tasks = list(result["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = result["tasks"][task]["rows"]
        for r in rows:
            lo, hi = r["interval"]
            ref = r["policy"] in REFERENCES  # drawn on top: a rule that changes nothing hides under its reference
            ax.errorbar(r["tpf"], r["accuracy"], yerr=[[r["accuracy"] - lo], [hi - r["accuracy"]]], fmt="o", capsize=3,
                        color="C3" if ref else "C0", zorder=3 if ref else 2)
        ax.set_title(f"{task} (n = {result['n']})")
        ax.set_xlabel("tokens per forward (TPF)")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        place_labels(ax, [(r["tpf"], r["accuracy"], r["policy"], {"fontsize": 8}) for r in rows],
                     [(r["tpf"], r["accuracy"]) for r in rows])
    fig.savefig(path, dpi=110, format="png")  # format: the path may be a temporary name (see save)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES), metavar="POLICY")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--out", type=Path, help="folder for catalogue.md, catalogue.json and catalogue.png")
    ap.add_argument("--redraw", action="store_true", help="only redraw --out's table and chart from its catalogue.json")
    args = ap.parse_args(argv)
    if args.redraw:
        if args.out is None or not (args.out / "catalogue.json").is_file():
            ap.error("--redraw: needs --out holding a catalogue.json")
        result = json.loads((args.out / "catalogue.json").read_text())
        save(args.out, result, with_json=False)
        return 0
    if args.n < 1:
        ap.error(f"--n: must be >= 1 (got {args.n})")
    model, tokenizer = load_checkpoint(args.checkpoint)
    t0 = time.perf_counter()
    result = run(model, tokenizer, args.tasks, args.policies, args.n, args.seed, args.n_boot)
    result["command"] = (f"python experiments/catalogue.py {args.checkpoint} --n {args.n}"
                         + (f" --tasks {' '.join(args.tasks)}" if list(args.tasks) != list(TASKS) else ""))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    text = markdown(result)
    print(f"`{result['command']}` (seed {args.seed}, 1 thread, {result['seconds']:.0f} s)\n\n{text}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        save(args.out, result)
    return 0


def save(out: Path, result: dict[str, Any], with_json: bool = True) -> None:
    """Write the table (and the result as JSON) and the chart into ``out``, all or nothing: each goes to
    a temporary name and none is renamed into place before all are complete (a failed chart leaves the
    previous files)."""
    writers = {"catalogue.md": lambda tmp: tmp.write_text(markdown(result))}
    if with_json:
        writers["catalogue.json"] = lambda tmp: tmp.write_text(json.dumps(result, indent=1))
    writers["catalogue.png"] = lambda tmp: chart(result, tmp)
    atomic_write_many(out, writers)


if __name__ == "__main__":
    raise SystemExit(main())
