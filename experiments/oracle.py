"""The catalogue against the reference rule on the oracle tasks: TPF at 0.95 accuracy, with intervals.

    python experiments/oracle.py --n 400 --out docs/oracle

For each oracle task (:data:`TASKS`, exact models ``oracle:TASK``) and each strategy family
(:data:`FAMILIES`: a rule and the grid of its main knob), every grid point decodes the same ``n`` eval
instances (seed 0, temperature 1, one block holding the answer and its EOS, no post steps unless the
family says so). A family's TPF at 0.95 accuracy is read off the upper envelope of its (TPF, accuracy)
points by linear interpolation (:func:`dlm_toolkit.sweep.reference.tpf_at_accuracy`); its interval is
the same reading on the envelopes of the points' 95 % Wilson bounds (low bound: a pessimistic curve,
high bound: an optimistic one). ``>= x``: every point of the family is at 0.95 or above (its fastest
is x; also where the envelope never crosses 0.95, e.g. a family whose faster points are
less accurate but not on the envelope); ``-``: none reaches 0.95. ``--out`` writes ``oracle.md`` (the table) and ``oracle.json`` (every point).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
from dlm_toolkit.evaluation.stats import wilson
from dlm_toolkit.sweep.reference import tpf_at_accuracy
from dlm_toolkit.tasks import get_task
from dlm_toolkit.util.files import atomic_write_many

TASKS: dict[str, dict[str, Any]] = {
    "list_shuffle": {"n_items": 6}, "list_replace": {"n_items": 6}, "list_insert": {"n_items": 6},
    "latin_square": {"order": 3},
}
TARGET = 0.95
# label -> (flat overrides shared by the grid, knob, values)
FAMILIES: dict[str, tuple[dict[str, Any], str, list[Any]]] = {
    "reference (eps)": ({"m2t.name": "reference"}, "m2t.params.eps", [0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9]),
    "threshold": ({"m2t.name": "threshold"}, "m2t.params.threshold", [0.95, 0.7, 0.5, 0.3, 0.2, 0.1, 0.02]),
    "topk (steps)": ({"m2t.name": "topk"}, "m2t.params.steps_per_block", [16, 10, 7, 5, 4, 3, 2, 1]),
    "factor": ({"m2t.name": "factor"}, "m2t.params.factor", [0.2, 0.5, 1.0, 2.0, 4.0, 8.0]),
    "entropy_bound (gamma)": ({"m2t.name": "entropy_bound"}, "m2t.params.gamma", [0.0, 0.25, 0.5, 1.0, 1.5, 2.0]),
    "threshold + T2T edits": ({"m2t.name": "threshold", "t2t.name": "threshold", "t2t.params.threshold": 0.5,
                               "blocks.params.max_post_steps": 4}, "m2t.params.threshold", [0.7, 0.5, 0.3, 0.2, 0.1, 0.02]),
}


def base_policy(block: int) -> dict[str, Any]:
    return {"m2t": {"name": "threshold"}, "t2t": {"name": "none"}, "remask": {"name": "none"},
            "blocks": {"name": "semi_ar", "params": {"block_length": block, "max_post_steps": 0, "align": "prompt"}},
            "sampling": {"temperature": 1.0}}


def family_points(task_name: str, n: int) -> dict[str, list[dict[str, float]]]:
    from dlm_toolkit.decoding.policy import DecodingPolicy

    model, tok = load_checkpoint(f"oracle:{task_name}")
    task = get_task(task_name, **TASKS[task_name])
    block = task.answer_length + 1
    out: dict[str, list[dict[str, float]]] = {}
    for label, (fixed, knob, values) in FAMILIES.items():
        pts = []
        for v in values:
            policy = DecodingPolicy(base_policy(block), **fixed, **{knob: v})
            m = evaluate(model, tok, task, policy, n, 0, batch_size=n, progress=False).metrics
            lo, hi = wilson(m["accuracy"] * n, n)
            pts.append({"value": v, "tpf": m["tpf"], "accuracy": m["accuracy"], "lo": lo, "hi": hi})
        out[label] = pts
        print(task_name, label, [(round(p["tpf"], 2), round(p["accuracy"], 3)) for p in pts], flush=True)
    return out


def at_target(points: list[dict[str, float]]) -> tuple[str, float | None]:
    """(text, TPF) of a family at :data:`TARGET` accuracy, with the interval from the Wilson bounds."""
    def read(key: str) -> float | None:
        tpf = tpf_at_accuracy([{"tpf": p["tpf"], "accuracy": p[key]} for p in points], TARGET)
        above = [p["tpf"] for p in points if p[key] >= TARGET]
        return tpf if tpf is not None or not above else max(above)  # no crossing: the fastest point above

    mid, lo, hi = read("accuracy"), read("lo"), read("hi")
    if mid is None:
        return "-", None
    crossed = tpf_at_accuracy(points, TARGET) is not None
    low = "?" if lo is None else f"{lo:.2f}"
    return (f"{mid:.2f} [{low}, {hi:.2f}]" if crossed and hi is not None else f">= {mid:.2f}"), mid


def table(results: dict[str, dict[str, list[dict[str, float]]]], n: int) -> str:
    tasks = list(results)
    lines = [f"TPF at {TARGET} accuracy (n = {n} per point, temperature 1; [95 % Wilson-bound envelopes]); "
             "ratio: the family's TPF over the reference rule's", "",
             "| strategy | " + " | ".join(f"`{t}` {TASKS[t]}" for t in tasks) + " |",
             "|---|" + "---|" * len(tasks)]
    ref = {t: at_target(results[t]["reference (eps)"])[1] for t in tasks}
    for label in FAMILIES:
        cells = []
        for t in tasks:
            text, value = at_target(results[t][label])
            ratio = "" if value is None or not ref[t] or label.startswith("reference") else f" ({value / ref[t]:.2f}x)"
            cells.append(text + ratio)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--from-json", type=Path, default=None, help="rewrite the table from a stored oracle.json")
    args = ap.parse_args()
    if args.from_json is not None:
        stored = json.loads(args.from_json.read_text())
        results, args.n = stored["points"], stored["n"]
    else:
        results = {t: family_points(t, args.n) for t in TASKS}
    text = table(results, args.n)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = json.dumps({"n": args.n, "target": TARGET, "tasks": TASKS, "points": results}, indent=1)
        atomic_write_many(args.out, {"oracle.md": lambda tmp: tmp.write_text(text),
                                     "oracle.json": lambda tmp: tmp.write_text(payload + "\n")})


if __name__ == "__main__":
    main()
