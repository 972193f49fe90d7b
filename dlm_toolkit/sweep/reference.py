"""The reference front of a sweep on an oracle model (issue 44): how far each trial is from the best
adaptive parallelism along the confidence ranking.

When the sweep's model exposes its joint (``--checkpoint oracle:TASK``, ``model: oracle:TASK``), the
study first evaluates the reference rule (``m2t: reference``, ``strategies/m2t_reference.py``) at each
``eps`` of :data:`EPS_GRID`, on the experiment's instances with the base policy's blocks and sampling,
and stores the points in the study (user attribute :data:`REFERENCE_ATTR`). Each trial then records
two gaps as MLflow metrics (and in its Optuna metrics):

* ``ref_accuracy_gap``: the reference curve's accuracy at the trial's TPF minus the trial's accuracy
  (positive: the reference is better at that speed);
* ``ref_tpf_gap``: the reference curve's TPF at the trial's accuracy minus the trial's TPF (positive:
  the reference is faster at that quality).

The curve is the upper envelope of the reference points (accuracy non-increasing in TPF), linearly
interpolated between points; a gap is left out where the trial's TPF or accuracy lies outside the
curve's range (no extrapolation). ``pareto.png`` draws the curve (:func:`draw_reference`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dlm_toolkit.evaluation.stats import envelope

__all__ = ["EPS_GRID", "REFERENCE_ATTR", "accuracy_at_tpf", "draw_reference", "envelope", "reference_curve",
           "reference_gaps", "study_reference", "tpf_at_accuracy"]

EPS_GRID = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0)
REFERENCE_ATTR = "oracle_reference"


def reference_curve(model: Any, tokenizer: Any, task: Any, base_policy: Any, n: int, seed: int,
                    batch_size: int = 32, eps_grid: Sequence[float] = EPS_GRID) -> list[dict[str, float]]:
    """``[{eps, tpf, accuracy, n}]``: the reference rule at each ``eps`` with ``base_policy``'s blocks and
    sampling (no edits, no remasking), on ``n`` eval instances of ``task`` from ``seed``."""
    from dlm_toolkit.evaluation.evaluate import evaluate
    from dlm_toolkit.decoding.policy import DecodingPolicy

    out = []
    for eps in eps_grid:
        policy = DecodingPolicy(base_policy, **{"m2t.name": "reference", "m2t.params.eps": float(eps), "t2t.name": "none",
                                         "remask.name": "none"})
        m = evaluate(model, tokenizer, task, policy, n, seed, batch_size=batch_size, progress=False).metrics
        out.append({"eps": float(eps), "tpf": m["tpf"], "accuracy": m["accuracy"], "n": float(n)})
    return out


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]  # one point


def accuracy_at_tpf(points: Sequence[Mapping[str, float]], tpf: float) -> float | None:
    """The reference envelope's accuracy at ``tpf`` (None outside its TPF range)."""
    env = envelope(points)
    return _interp(tpf, [t for t, _ in env], [a for _, a in env])


def tpf_at_accuracy(points: Sequence[Mapping[str, float]], accuracy: float) -> float | None:
    """The reference envelope's TPF at ``accuracy`` (None outside its accuracy range)."""
    env = envelope(points)[::-1]  # accuracy ascending
    return _interp(accuracy, [a for _, a in env], [t for t, _ in env])


def reference_gaps(points: Sequence[Mapping[str, float]], metrics: Mapping[str, float]) -> dict[str, float]:
    """``ref_accuracy_gap`` and ``ref_tpf_gap`` of a trial's ``metrics`` (module docstring)."""
    out = {}
    acc = accuracy_at_tpf(points, metrics["tpf"])
    if acc is not None:
        out["ref_accuracy_gap"] = acc - metrics["accuracy"]
    tpf = tpf_at_accuracy(points, metrics["accuracy"])
    if tpf is not None:
        out["ref_tpf_gap"] = tpf - metrics["tpf"]
    return out


def study_reference(study: Any, model: Any, tokenizer: Any, task: Any, exp: Any) -> list[dict[str, float]] | None:
    """The study's reference curve: stored, else computed and stored; None for a model without a joint."""
    if not callable(getattr(model, "joint_consistency", None)):
        return None
    stored = study.user_attrs.get(REFERENCE_ATTR)
    if stored:
        return list(stored)
    curve = reference_curve(model, tokenizer, task, exp.base_policy, exp.n, exp.seed, exp.batch_size)
    study.set_user_attr(REFERENCE_ATTR, curve)
    return curve


def draw_reference(ax: Any, points: Sequence[Mapping[str, float]]) -> None:
    """The reference curve on a (TPF, accuracy) axes: its envelope as a dashed line, each eps marked."""
    env = envelope(points)
    ax.plot([t for t, _ in env], [a for _, a in env], "--", color="tab:red", lw=1.2, zorder=2,
            label="reference rule (oracle joint, eps sweep)")
    ax.scatter([p["tpf"] for p in points], [p["accuracy"] for p in points], s=14, marker="x", color="tab:red", zorder=2)
