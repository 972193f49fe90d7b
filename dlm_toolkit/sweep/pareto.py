"""The speed–quality Pareto front of a sweep, its summary numbers, table, CSV and plot.

Definitions (also printed in ``dlm pareto`` and logged to the study's MLflow parent run by a sweep
and ``dlm pareto --log``):

* **front**: the COMPLETE trials that no other COMPLETE trial dominates in the study's
  objectives (``a`` dominates ``b``: at least as good in every objective and strictly better
  in one). Pruned and failed trials never enter it. Two trials with identical values are
  both on the front.
* **dominates a preset**: the trial dominates the COMPLETE trial that ran that preset
  (enqueued by the sweep, ``preset`` user attribute).
* **hypervolume**: area dominated by the (accuracy, TPF) front — both maximised — above the
  reference point (accuracy 0, TPF 0). With this reference point it equals the area under
  the front's staircase; units accuracy × tokens-per-forward.
* **auc**: area under the piecewise-linear accuracy(TPF) curve through the (accuracy, TPF)
  front points (trapezoids), from the front's lowest to its highest TPF; 0 for one point.
* **speedup at quality** (per preset): the highest ``tpf / preset tpf`` over COMPLETE trials
  whose accuracy is >= the preset's accuracy.

TPF counts generated tokens up to and including the first EOS, per forward.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from dlm_toolkit.util.files import atomic_write, replacing, write_text

HV_REFERENCE = (0.0, 0.0)
"""Reference point (accuracy, TPF) of :func:`hypervolume_2d`."""


# -- pure geometry -----------------------------------------------------------------------------
def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    """Whether point ``a`` Pareto-dominates ``b`` (``directions``: 'maximize'/'minimize' each)."""
    better = False
    for x, y, d in zip(a, b, directions):
        if d == "minimize":
            x, y = -x, -y
        if x < y:
            return False
        if x > y:
            better = True
    return better


def non_dominated(points: Sequence[Sequence[float]], directions: Sequence[str]) -> list[int]:
    """Indices of the points no other point dominates, in input order."""
    return [i for i, p in enumerate(points)
            if not any(dominates(q, p, directions) for j, q in enumerate(points) if j != i)]


def hypervolume_2d(points: Sequence[tuple[float, float]], reference: tuple[float, float] = HV_REFERENCE) -> float:
    """Area dominated by ``points`` (both coordinates maximised) above ``reference``."""
    pts = sorted({(x, y) for x, y in points if x > reference[0] and y > reference[1]}, key=lambda p: (-p[0], -p[1]))
    area, best_y = 0.0, reference[1]
    for x, y in pts:  # decreasing x: each point adds the strip it raises above the best y so far
        if y > best_y:
            area += (x - reference[0]) * (y - best_y)
            best_y = y
    return area


def front_auc(points: Sequence[tuple[float, float]]) -> float:
    """Trapezoidal area under accuracy(TPF) through the (accuracy, TPF) non-dominated points."""
    front = [points[i] for i in non_dominated(points, ("maximize", "maximize"))]
    curve = sorted({(tpf, acc) for acc, tpf in front})
    return sum((t1 - t0) * (a0 + a1) / 2 for (t0, a0), (t1, a1) in zip(curve, curve[1:]))


# -- study summary -----------------------------------------------------------------------------
@dataclass
class TrialPoint:
    """One COMPLETE trial: its number, metrics, sampled params and preset name (if any)."""

    trial: int
    metrics: dict[str, float]
    params: dict[str, Any] = field(default_factory=dict)
    preset: str | None = None
    policy_hash: str | None = None
    outcomes: str | None = None  # per-instance right/wrong, see :func:`encode_outcomes`


def encode_outcomes(scores: Sequence[float]) -> str:
    """Per-instance right (score >= 0.5) / wrong as ``"<n>:<hex bits>"``: 256 instances take 68
    characters, so it fits an Optuna user attribute and the trials stay comparable pairwise."""
    bits = "".join("1" if s >= 0.5 else "0" for s in scores)
    return f"{len(bits)}:{int(bits, 2):x}" if bits else "0:"


def decode_outcomes(text: str) -> list[bool]:
    """Inverse of :func:`encode_outcomes`."""
    n, _, hexbits = text.partition(":")
    count = int(n)
    return [c == "1" for c in format(int(hexbits or "0", 16), f"0{count}b")] if count else []


def tied_accuracy(a: TrialPoint, b: TrialPoint, alpha: float = 0.05) -> float | None:
    """McNemar p-value of ``a`` vs ``b`` on their shared instances when it does not reject "same
    accuracy" at ``alpha`` (a statistical tie), else None. None too when either trial has no
    outcomes or they cover different instance counts."""
    from dlm_toolkit.evaluation.stats import mcnemar_exact

    if not a.outcomes or not b.outcomes:
        return None
    x, y = decode_outcomes(a.outcomes), decode_outcomes(b.outcomes)
    if len(x) != len(y):
        return None
    p = mcnemar_exact(sum(u and not v for u, v in zip(x, y)), sum(v and not u for u, v in zip(x, y)))
    return p if p >= alpha else None


@dataclass
class ParetoSummary:
    """The front and its summary numbers (see the module docstring for definitions)."""

    study_name: str
    objectives: dict[str, str]
    points: list[TrialPoint]
    front: list[TrialPoint]
    presets: dict[str, TrialPoint | None]
    dominated_by: dict[str, list[int]]
    speedup_at_quality: dict[str, dict[str, float] | None]
    hypervolume: float | None
    auc: float | None
    counts: dict[str, int] = field(default_factory=dict)
    reference: list[dict[str, float]] | None = None  # an oracle study's reference curve (dlm_toolkit.sweep.reference)

    def values(self, p: TrialPoint) -> list[float]:
        return [p.metrics[m] for m in self.objectives]

    def dominates_presets(self, p: TrialPoint) -> dict[str, bool | None]:
        """For each preset: does ``p`` dominate it (None when the preset has no COMPLETE trial)."""
        dirs = list(self.objectives.values())
        return {name: (None if pt is None else dominates(self.values(p), self.values(pt), dirs))
                for name, pt in self.presets.items()}

    def ties(self, p: TrialPoint) -> dict[str, float | None]:
        """For each preset: the McNemar p-value when ``p``'s accuracy is statistically tied with it
        (same instances, p >= 0.05), else None (see :func:`tied_accuracy`)."""
        return {name: (None if pt is None or pt.trial == p.trial else tied_accuracy(p, pt))
                for name, pt in self.presets.items()}

    def rows(self) -> list[dict[str, Any]]:
        """The front as rows: trial, preset, objective metrics (+ accuracy, tpf), dominates_*,
        tied_accuracy_* (McNemar p when tied with that preset, else None), params."""
        out = []
        for p in self.front:
            row: dict[str, Any] = {"trial": p.trial, "preset": p.preset}
            for m in dict.fromkeys([*self.objectives, "accuracy", "tpf"]):
                row[m] = p.metrics.get(m)
            for name, dom in self.dominates_presets(p).items():
                row[f"dominates_{name}"] = dom
            for name, tie in self.ties(p).items():
                row[f"tied_accuracy {name}"] = tie
            row["params"] = p.params
            row["policy_hash"] = p.policy_hash
            out.append(row)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "study_name": self.study_name,
            "objectives": self.objectives,
            "front": self.rows(),
            "presets": {k: (None if v is None else {"trial": v.trial, "metrics": v.metrics})
                        for k, v in self.presets.items()},
            "dominated_by": self.dominated_by,
            "speedup_at_quality": self.speedup_at_quality,
            "hypervolume": self.hypervolume,
            "hypervolume_reference": {"accuracy": HV_REFERENCE[0], "tpf": HV_REFERENCE[1]},
            "auc": self.auc,
            "counts": self.counts,
            **({"reference": self.reference} if self.reference else {}),
        }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def summarize_points(study_name: str, objectives: dict[str, str], points: list[TrialPoint],
                     counts: dict[str, int] | None = None, preset_names: Sequence[str] = ()) -> ParetoSummary:
    """Build a :class:`ParetoSummary` from COMPLETE trial points (used by :func:`summarize`).

    ``preset_names``: presets to list even when they have no COMPLETE trial (yet).
    """
    names, dirs = list(objectives), list(objectives.values())
    every = points
    # a damaged or tampered store can hold NaN/inf metrics: such a trial is kept in ``points`` (the pages
    # name it as left out) but takes no part in the front, dominance, speedups or areas (NaN compares false
    # both ways, so it would sit on the front and crowd the true front out)
    points = [p for p in points if all(_finite(p.metrics.get(m)) for m in names)]
    vals = [[p.metrics[m] for m in names] for p in points]
    front = [points[i] for i in non_dominated(vals, dirs)]
    front.sort(key=lambda p: (p.metrics.get("tpf", 0.0), p.trial))
    presets: dict[str, TrialPoint | None] = {}
    for p in points:
        if p.preset:
            presets[p.preset] = p  # the last COMPLETE one (a retried preset has one COMPLETE)
    for name in preset_names:
        presets.setdefault(name, None)
    dominated_by: dict[str, list[int]] = {}
    speedup: dict[str, dict[str, float] | None] = {}
    for name, pt in presets.items():
        if pt is None:
            dominated_by[name], speedup[name] = [], None
            continue
        pv = [pt.metrics[m] for m in names]
        dominated_by[name] = [p.trial for p, v in zip(points, vals) if dominates(v, pv, dirs)]
        best = None
        if pt.metrics.get("tpf"):
            for p in points:
                if p.metrics["accuracy"] >= pt.metrics["accuracy"]:
                    ratio = p.metrics["tpf"] / pt.metrics["tpf"]
                    if best is None or ratio > best["ratio"]:
                        best = {"trial": p.trial, "ratio": ratio, "accuracy": p.metrics["accuracy"],
                                "tpf": p.metrics["tpf"]}
        speedup[name] = best
    plane = [(p.metrics["accuracy"], p.metrics["tpf"]) for p in points if "accuracy" in p.metrics and "tpf" in p.metrics]
    return ParetoSummary(
        study_name=study_name, objectives=dict(objectives), points=every, front=front, presets=presets,
        dominated_by=dominated_by, speedup_at_quality=speedup,
        hypervolume=hypervolume_2d(plane) if plane else None, auc=front_auc(plane) if plane else None,
        counts=dict(counts or {}),
    )


def summarize(study: Any) -> ParetoSummary:
    """The summary of an Optuna study created by ``dlm sweep`` (objectives from its settings)."""
    from optuna.trial import TrialState

    from dlm_toolkit.sweep.attrs import read_settings, trial_metrics, trial_outcomes, trial_text

    settings = read_settings(study) or {}
    objectives = settings.get("objectives") or {f"objective_{i}": d.name.lower() for i, d in enumerate(study.directions)}
    points, counts = [], {"complete": 0, "pruned": 0, "failed": 0, "running": 0, "waiting": 0}
    for t in study.get_trials(deepcopy=False):
        key = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned", TrialState.FAIL: "failed",
               TrialState.RUNNING: "running", TrialState.WAITING: "waiting"}[t.state]
        counts[key] += 1
        if t.state != TrialState.COMPLETE:
            continue
        if t.user_attrs.get("duplicate_of") is not None:  # its original already stands for the policy
            counts["duplicates"] = counts.get("duplicates", 0) + 1
            continue
        metrics = trial_metrics(t)
        for name, value in zip(objectives, t.values or []):
            metrics.setdefault(name, value)
        points.append(TrialPoint(t.number, metrics, dict(t.params), trial_text(t, "preset"),
                                 trial_text(t, "policy_hash"), trial_outcomes(t)))
    from dlm_toolkit.sweep.reference import REFERENCE_ATTR

    summary = summarize_points(study.study_name, objectives, points, counts,
                               preset_names=[preset_label(p) for p in settings.get("presets_to_enqueue") or []])
    summary.reference = study.user_attrs.get(REFERENCE_ATTR)
    return summary


def preset_label(preset: str) -> str:
    """How a preset is named in trials and tables: the preset name, or a policy file's stem."""
    return Path(preset).stem if Path(preset).suffix in (".json", ".yaml", ".yml") else preset


# -- outputs -----------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def params_text(params: dict[str, Any]) -> str:
    """A trial's parameters as one line, ``key=value`` sorted by key (the front table's column, the
    title of a trial's decode page)."""
    return " ".join(f"{k}={_fmt(v)}" for k, v in sorted(params.items()))


def cut_list(items: Sequence[Any], most: int = 10) -> str:
    """``[a, b, c]``, or the first ``most`` then ``..., +N more`` (a cut list says it is cut)."""
    shown = ", ".join(map(str, items[:most]))
    return f"[{shown}]" if len(items) <= most else f"[{shown}, ... +{len(items) - most} more]"


def trial_count(summary: ParetoSummary) -> str:
    """``"N complete trials"`` counted as the sweep counts them (a repeat of a stored policy is a
    complete trial, but only its original is a point): both numbers when they differ."""
    complete, repeats = summary.counts.get("complete"), summary.counts.get("duplicates", 0)
    if complete is None or not repeats:
        return f"{len(summary.points)} complete trials"
    return (f"{complete} complete trials ({len(summary.points)} distinct points; {repeats} repeated a stored "
            "policy and reused its result: duplicate_of)")


def auc_text(summary: ParetoSummary) -> str:
    """The AUC, or ``n/a`` when the front has fewer than two distinct (TPF, accuracy) points (no
    curve has an area: a single point is not an AUC of 0)."""
    plane = [(p.metrics["accuracy"], p.metrics["tpf"]) for p in summary.points if "accuracy" in p.metrics and "tpf" in p.metrics]
    distinct = {plane[i] for i in non_dominated(plane, ("maximize", "maximize"))}  # the points front_auc joins
    if summary.auc is None or len(distinct) < 2:
        return "n/a (one point on the front)"
    return f"{summary.auc:.4g}"


def format_table(summary: ParetoSummary) -> str:
    """The front as a plain-text table plus the summary numbers."""
    metrics = list(dict.fromkeys([*summary.objectives, "accuracy", "tpf"]))
    head = ["trial", "preset", *metrics, *[f"dom {p}" for p in summary.presets], "tied with", "params"]
    rows = []
    same: dict[str, list[TrialPoint]] = {}  # samplers may propose a policy again: one row per policy
    for p in summary.front:
        same.setdefault(p.policy_hash or f"#{p.trial}", []).append(p)
    for group in same.values():
        p = next((q for q in group if q.preset), group[0])
        params = params_text(p.params) if not p.preset else ""
        trial = str(p.trial) + (f" (={','.join(str(q.trial) for q in group if q is not p)})" if len(group) > 1 else "")
        tied = ",".join(name for name, tie in summary.ties(p).items() if tie is not None)
        rows.append([trial, p.preset or "", *[_fmt(p.metrics.get(m)) for m in metrics],
                     *[_fmt(d) for d in summary.dominates_presets(p).values()], tied or "-", params])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = [f"Pareto front of study '{summary.study_name}' ("
             + ", ".join(f"{d} {m}" for m, d in summary.objectives.items())
             + f"); {len(summary.front)} on the front of {trial_count(summary)}"
             + (f", {len(rows)} distinct policies" if len(rows) != len(summary.front) else "")]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if not rows:
        other = ", ".join(f"{summary.counts[k]} {k}" for k in ("pruned", "failed", "running", "waiting")
                          if summary.counts.get(k))
        lines.append(f"(no complete trials{': ' + other if other else ''})")
    if summary.hypervolume is not None:
        lines.append(f"hypervolume (accuracy x TPF, reference (0, 0)): {summary.hypervolume:.4g}; "
                     f"AUC of accuracy over TPF along the front: {auc_text(summary)}")
    for name, pt in summary.presets.items():
        if pt is None:
            lines.append(f"preset {name}: no complete trial")
            continue
        dom = summary.dominated_by[name]
        sp = summary.speedup_at_quality.get(name)
        sp_text = (f"; best TPF at >= its accuracy: {sp['ratio']:.2f}x (trial {sp['trial']})" if sp else "")
        lines.append(f"preset {name} (trial {pt.trial}): accuracy {pt.metrics['accuracy']:.4g}, "
                     f"tpf {pt.metrics['tpf']:.4g}; dominated by "
                     f"{len(dom)} trial(s){' ' + cut_list(dom) if dom else ''}{sp_text}")
    lines.append("TPF = generated tokens up to and including the first EOS, per forward. 'tied with': the exact "
                 "McNemar test on the same instances does not tell its accuracy from the preset's (p >= 0.05).")
    return "\n".join(lines)


def write_csv(summary: ParetoSummary, path: str | Path) -> Path:
    """Every COMPLETE trial, one row each, with ``on_front`` and ``dominates_<preset>`` columns."""
    path = Path(path)
    on_front = {p.trial for p in summary.front}
    metric_keys = sorted({k for p in summary.points for k in p.metrics})
    param_keys = sorted({k for p in summary.points for k in p.params})
    head = ["trial", "preset", "on_front", *metric_keys, *[f"dominates_{n}" for n in summary.presets],
            *[f"tied_accuracy {n}" for n in summary.presets], *[f"param {k}" for k in param_keys], "policy_hash"]
    with replacing(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(head)
        for p in sorted(summary.points, key=lambda p: p.trial):
            dom, ties = summary.dominates_presets(p), summary.ties(p)
            w.writerow([p.trial, p.preset or "", p.trial in on_front, *[p.metrics.get(k) for k in metric_keys],
                        *[dom[n] for n in summary.presets], *[ties[n] for n in summary.presets],
                        *[p.params.get(k, "") for k in param_keys],
                        p.policy_hash or ""])
    return path


def write_json(summary: ParetoSummary, path: str | Path) -> Path:
    path = Path(path)
    write_text(path, json.dumps(summary.to_json(), indent=1, default=str) + "\n")
    return path


def plot(summary: ParetoSummary, path: str | Path) -> Path:
    """``pareto.png``: all COMPLETE trials, the (accuracy, TPF) front as a step line, presets labelled.

    Trials at the same point (a re-proposed policy, a tie) draw as one dot, larger with each trial and
    labelled with all of their numbers (front) or their count (elsewhere), so none hides behind another.
    """
    import matplotlib.pyplot as plt

    path = Path(path)
    fig = figure(summary)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return path


def stacks(points: Sequence[TrialPoint]) -> list[tuple[float, float, list[int]]]:
    """(TPF, accuracy, trial numbers) of each distinct point, the numbers ascending."""
    by_xy: dict[tuple[float, float], list[int]] = {}
    for p in points:
        by_xy.setdefault((p.metrics["tpf"], p.metrics["accuracy"]), []).append(p.trial)
    return [(x, y, sorted(trials)) for (x, y), trials in by_xy.items()]


def stack_label(trials: Sequence[int], most: int = 3) -> str:
    """``"4,9,12"``; beyond ``most`` numbers ``"4,9,12 +2"``."""
    shown = ",".join(map(str, trials[:most]))
    return shown if len(trials) <= most else f"{shown} +{len(trials) - most}"


def figure(summary: ParetoSummary) -> Any:
    """The matplotlib figure of :func:`plot` (the caller closes it)."""
    import matplotlib.pyplot as plt  # matplotlib picks a headless backend by itself when there is no display

    from dlm_toolkit.evaluation.plots import place_labels

    from dlm_toolkit.viewer.front import plottable

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    pts, left_out = plottable(summary.points)  # a damaged store's NaN or out-of-range metrics are not drawn
    drawn = {p.trial for p in pts}
    everything = stacks(pts)
    ax.scatter([x for x, _, _ in everything], [y for _, y, _ in everything],
               s=[18 * len(t) for _, _, t in everything], c="0.6", label=f"trials ({len(pts)} complete)", zorder=2)
    plane = [(p.metrics["accuracy"], p.metrics["tpf"]) for p in pts]
    front = sorted((pts[i] for i in non_dominated(plane, ("maximize", "maximize"))),
                   key=lambda p: p.metrics["tpf"])
    front_stacks = stacks(front)
    on_front = {(x, y) for x, y, _ in front_stacks}
    labels: list[tuple[float, float, str, dict]] = []  # placed last, around every marker
    for i, (name, pt) in enumerate(summary.presets.items()):
        if pt is None or pt.trial not in drawn:
            continue
        ax.scatter([pt.metrics["tpf"]], [pt.metrics["accuracy"]], s=90, marker="*", zorder=5,
                   color=f"C{(i + 1) % 10}", edgecolor="k", label=f"preset {name}")
        _interval_bars(ax, [pt], f"C{(i + 1) % 10}")
        labels.append((pt.metrics["tpf"], pt.metrics["accuracy"], name, {"fontsize": 8}))
    if front:
        xs = [p.metrics["tpf"] for p in front]
        ys = [p.metrics["accuracy"] for p in front]
        ax.step(xs, ys, where="pre", color="tab:blue", lw=1.5, zorder=3, label="front (accuracy, TPF)")
        ax.scatter(xs, ys, s=28, color="tab:blue", zorder=4)
        _interval_bars(ax, front, "tab:blue")
        labels += [(x, y, stack_label(trials), {"fontsize": 7, "color": "tab:blue"}) for x, y, trials in front_stacks]
    if summary.reference:
        from dlm_toolkit.sweep.reference import draw_reference

        draw_reference(ax, summary.reference)
    labels += [(x, y, f"x{len(trials)}", {"fontsize": 6, "color": "0.4"})
               for x, y, trials in everything if len(trials) > 1 and (x, y) not in on_front]
    ax.set_xlabel("TPF (generated tokens up to first EOS / forward)")
    ax.set_ylabel("accuracy (bars: 95 % Wilson interval)")
    title = f"{summary.study_name}: speed–quality trade-off"
    if summary.hypervolume is not None:
        title += f"  (HV {summary.hypervolume:.3g})"
    if left_out:
        title += f"\n(not drawn, metrics not finite or out of range: trials {cut_list(left_out)})"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    markers = [(x, y) for x, y, _ in everything] + [(p.metrics["tpf"], p.metrics["accuracy"])
                                                   for p in summary.presets.values() if p is not None and p.trial in drawn]
    place_labels(ax, labels, markers)
    return fig


def _interval_bars(ax: Any, points: Sequence[TrialPoint], color: str) -> None:
    """Vertical 95 % Wilson intervals of the points' accuracies (points without ``n`` get none)."""
    from dlm_toolkit.evaluation.stats import wilson

    pts = [p for p in points if p.metrics.get("n")]
    if not pts:
        return
    lows, highs = zip(*(wilson(p.metrics["accuracy"] * p.metrics["n"], int(p.metrics["n"])) for p in pts))
    ys = [p.metrics["accuracy"] for p in pts]
    ax.errorbar([p.metrics["tpf"] for p in pts], ys, yerr=[[y - lo for y, lo in zip(ys, lows)],
                [hi - y for y, hi in zip(ys, highs)]], fmt="none", ecolor=color, alpha=0.6, capsize=2, zorder=3)


def write_all(summary: ParetoSummary, folder: str | Path, runs: dict[int, str] | None = None) -> dict[str, Path]:
    """``pareto.png``, ``pareto.csv``, ``pareto.json`` and the explorer ``pareto.html`` (``runs``:
    trial number -> its MLflow run page, linked from the points) in ``folder`` (created)."""
    from dlm_toolkit.viewer.front import write_front

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    return {"png": plot(summary, folder / "pareto.png"), "csv": write_csv(summary, folder / "pareto.csv"),
            "json": write_json(summary, folder / "pareto.json"), "html": write_front(summary, folder / "pareto.html", runs)}
