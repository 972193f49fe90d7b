"""``pareto.html``: the sweep's front to explore, beside ``pareto.png``.

Every COMPLETE trial at (TPF, accuracy) with its accuracy interval (Wilson, 95 %); trials on the
front in colour, dominated trials grey, presets as stars (reference points). Hover shows the
trial's number, parameters, accuracy with its interval, TPF and its MLflow run; a click opens the
run. Plotly's JS is inline (``include_plotlyjs=True``): the page needs no network.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Mapping

from dlm_toolkit.util.files import write_text

TRACES = ("front", "dominated", "presets")  # trace names, in drawing order


def _hover(p: Any, interval: tuple[float, float], link: str | None) -> str:
    params = "<br>".join(f"{html.escape(str(k))} = {html.escape(json.dumps(v))}" for k, v in sorted(p.params.items()))
    lines = [f"<b>trial {p.trial}</b>" + (f" (preset {html.escape(p.preset)})" if p.preset else ""),
             f"accuracy {p.metrics['accuracy']:.4f} [{interval[0]:.4f}, {interval[1]:.4f}] (n={int(p.metrics.get('n', 0))})",
             f"TPF {p.metrics['tpf']:.3f} (tokens up to and including the first EOS per forward)"]
    if params:
        lines.append(params)
    lines.append(f"MLflow run: {html.escape(link)}" if link else "MLflow run: (not tracked)")
    return "<br>".join(lines)


def front_figure(summary: Any, runs: Mapping[int, str] | None = None) -> Any:
    """The plotly figure: traces ``front``, ``dominated`` and ``presets`` (:data:`TRACES`); each
    point's ``customdata`` is ``[trial, run link or ""]``."""
    import plotly.graph_objects as go

    from dlm_toolkit.evaluation.stats import wilson

    runs = runs or {}
    on_front = {p.trial for p in summary.front}
    groups: dict[str, list[Any]] = {name: [] for name in TRACES}
    for p in summary.points:
        if "accuracy" not in p.metrics or "tpf" not in p.metrics:
            continue
        groups["front" if p.trial in on_front else "dominated"].append(p)
        if p.preset:
            groups["presets"].append(p)
    style = {"front": dict(color="#1565c0", size=10, symbol="circle"),
             "dominated": dict(color="#b0b0b0", size=8, symbol="circle"),
             "presets": dict(color="#d84315", size=18, symbol="star-open", line=dict(width=2))}
    fig = go.Figure()
    for name in TRACES:
        pts = sorted(groups[name], key=lambda p: (p.metrics["tpf"], p.trial))
        intervals = [wilson(p.metrics["accuracy"] * p.metrics.get("n", 0), int(p.metrics.get("n", 0)))
                     if p.metrics.get("n") else (p.metrics["accuracy"], p.metrics["accuracy"]) for p in pts]
        ys = [p.metrics["accuracy"] for p in pts]
        fig.add_trace(go.Scatter(
            name={"front": "on the front", "dominated": "dominated", "presets": "presets"}[name],
            x=[p.metrics["tpf"] for p in pts], y=ys,
            mode={"front": "lines+markers", "dominated": "markers", "presets": "markers+text"}[name],
            text=[html.escape(p.preset) for p in pts] if name == "presets" else None, textposition="top center",
            line=dict(shape="hv", color="#1565c0", width=1) if name == "front" else None,
            marker=style[name],
            error_y=None if name == "presets" else dict(type="data", symmetric=False, thickness=1, width=2,
                                                         array=[hi - y for y, (_, hi) in zip(ys, intervals)],
                                                         arrayminus=[y - lo for y, (lo, _) in zip(ys, intervals)]),
            customdata=[[p.trial, runs.get(p.trial, "")] for p in pts],
            hovertext=[_hover(p, iv, runs.get(p.trial)) for p, iv in zip(pts, intervals)],
            hoverinfo="text", meta=name,
        ))
    if getattr(summary, "reference", None):  # an oracle study (dlm_toolkit.sweep.reference)
        fig.add_trace(reference_trace(summary.reference))
    fig.update_layout(title=f"{html.escape(summary.study_name)}: accuracy vs TPF (hover a point; click opens its run)",
                      xaxis_title="TPF (tokens up to and including the first EOS per forward)",
                      yaxis_title="accuracy (95 % Wilson interval)", template="plotly_white", hovermode="closest")
    return fig


def reference_trace(points: Any) -> Any:
    """The reference rule's curve of an oracle study (``summary.reference``): its envelope as a dashed
    line with each eps on hover; ``customdata`` has no run link, so a click opens nothing."""
    import plotly.graph_objects as go

    from dlm_toolkit.evaluation.stats import envelope

    env = envelope(points)
    eps = {(p["tpf"], p["accuracy"]): p["eps"] for p in points}
    return go.Scatter(name="reference rule (oracle joint)", x=[t for t, _ in env], y=[a for _, a in env],
                      mode="lines+markers", line=dict(dash="dash", color="#c62828", width=1.5),
                      marker=dict(symbol="x", size=7, color="#c62828"), customdata=[[-1, ""] for _ in env],
                      hovertext=[f"reference rule, eps {eps[xy]:g}<br>accuracy {xy[1]:.4f}, TPF {xy[0]:.3f}" for xy in env],
                      hoverinfo="text", meta="reference")


# Opens the clicked trial's MLflow run (customdata[1]) in a new tab.
_CLICK = """
var gd = document.getElementById('{plot_id}');
gd.on('plotly_click', function(ev){ var link = ev.points[0].customdata[1];
  if (link) { window.open(link, '_blank', 'noopener'); } });
"""


def front_page(summary: Any, runs: Mapping[int, str] | None = None) -> str:
    """``pareto.html`` as text. ``runs``: trial number -> its MLflow run page."""
    fig = front_figure(summary, runs)
    return fig.to_html(include_plotlyjs=True, full_html=True, post_script=_CLICK, div_id="pareto",
                       config={"displaylogo": False})


def write_front(summary: Any, path: str | Path, runs: Mapping[int, str] | None = None) -> Path:
    """Write ``pareto.html`` atomically; returns its path."""
    path = Path(path)
    write_text(path, front_page(summary, runs))
    return path
