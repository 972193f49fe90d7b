"""``pareto.html``: the sweep's front to explore, beside ``pareto.png``.

Every COMPLETE trial at (TPF, accuracy) with its accuracy interval (Wilson, 95 %); trials on the
front in colour joined by the front's step line, dominated trials grey, presets as stars
(reference points) with their names placed where they cover no other name and no marker. Hover
shows the trial's number, parameters, accuracy with its interval, TPF and its MLflow run; a click
opens the run. The figure is SVG drawn here with a few lines of inline JS (tens of kB, where
plotly's inline bundle made 4.8 MB): the page needs no network. A point whose metrics are not
finite or out of range (a tampered or damaged store) is left out, and the page says which.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from dlm_toolkit.evaluation.plots import rect_overlap
from dlm_toolkit.util.files import write_text
from dlm_toolkit.viewer.page import cut_text, script_json, valid_utf8

TRACES = ("front", "dominated", "presets")  # what a point is drawn as, in drawing order
WIDTH, HEIGHT = 900, 520
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 20, 60  # the plot area's margins, px
LABEL_FONT_PX, LABEL_CHAR_PX, LABEL_HEIGHT_PX = 12, 7.3, 14  # monospace: a label's box is known here
MARKER_PX = {"front": 5, "dominated": 4, "presets": 9}
# where a preset's name may go, relative to its star (px, y down): nearest first, then further out
OFFSETS = [(dx * r, dy * r) for r in (12, 22, 34, 48, 64) for dx, dy in
           ((1, -1), (1, 0.2), (-1, -1), (-1, 0.2), (0, -1.4), (0, 1.2), (1, 1), (-1, 1))]


def plottable(points: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """The points that can be drawn (finite TPF, accuracy in [0, 1], ``n`` absent or a whole number
    >= 0) and the trial numbers of the others (a point without accuracy or TPF is neither)."""
    good, bad = [], []
    for p in points:
        m = p.metrics
        if "accuracy" not in m or "tpf" not in m:
            continue
        acc, tpf, n = _num(m["accuracy"]), _num(m["tpf"]), _num(m.get("n", 0))
        ok = (acc is not None and 0.0 <= acc <= 1.0 and tpf is not None and n is not None and n >= 0
              and n.is_integer())
        (good if ok else bad).append(p if ok else p.trial)
    return good, bad


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def interval(p: Any) -> tuple[float, float]:
    """The 95 % Wilson interval of a plottable point's accuracy (the accuracy itself without ``n``)."""
    from dlm_toolkit.evaluation.stats import wilson

    acc, n = float(p.metrics["accuracy"]), int(p.metrics.get("n", 0))
    return wilson(acc * n, n) if n else (acc, acc)


@dataclass
class Axis:
    """A linear axis from ``lo`` to ``hi`` drawn from pixel ``a`` to pixel ``b``."""

    lo: float
    hi: float
    a: float
    b: float

    @classmethod
    def around(cls, values: Sequence[float], a: float, b: float) -> Axis:
        lo, hi = min(values, default=0.0), max(values, default=1.0)
        pad = (hi - lo) * 0.06 or max(abs(lo) * 0.1, 0.05)
        return cls(lo - pad, hi + pad, a, b)

    def px(self, v: float) -> float:
        return self.a + (v - self.lo) / (self.hi - self.lo) * (self.b - self.a)

    def ticks(self) -> list[float]:
        raw = (self.hi - self.lo) / 6
        step = 10 ** math.floor(math.log10(raw))
        step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
        first = math.ceil(self.lo / step)
        return [round(k * step, 10) for k in range(first, math.floor(self.hi / step) + 1)]


def _hover(p: Any, iv: tuple[float, float], link: str | None) -> str:
    lines = [f"trial {p.trial}" + (f" (preset {p.preset})" if p.preset else ""),
             f"accuracy {float(p.metrics['accuracy']):.4f} [{iv[0]:.4f}, {iv[1]:.4f}] (n={int(p.metrics.get('n', 0))})",
             f"TPF {float(p.metrics['tpf']):.3f} (tokens up to and including the first EOS per forward)"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in sorted(p.params.items())]
    lines.append(f"MLflow run: {link}" if link else "MLflow run: (not tracked)")
    return "\n".join(cut_text(line, 300) for line in lines)


def place(anchors: Sequence[tuple[float, float, str]], markers: Sequence[tuple[float, float, float]],
          box: tuple[float, float, float, float]) -> list[tuple[float, float, float, float]]:
    """Each label ``(x, y, text)`` (px) at the first offset of :data:`OFFSETS` where its box
    overlaps no label placed before it and no marker ``(x, y, radius)`` and stays inside ``box``;
    where none is free, at the least overlap. Returns the boxes (x0, y0, x1, y1)."""
    blocked = [(x - r, y - r, x + r, y + r) for x, y, r in markers]
    placed = []
    for x, y, text in anchors:
        w = LABEL_CHAR_PX * len(text) + 4
        best: tuple[float, tuple[float, float, float, float]] | None = None
        for dx, dy in OFFSETS:
            x0 = x + dx - (w if dx < 0 else 0 if dx > 0 else w / 2)
            y0 = y + dy - (LABEL_HEIGHT_PX if dy <= 0 else 0)
            rect = (x0, y0, x0 + w, y0 + LABEL_HEIGHT_PX)
            cost = sum(rect_overlap(rect, other) for other in blocked)
            cost += 1e6 * (rect[0] < box[0] or rect[2] > box[2] or rect[1] < box[1] or rect[3] > box[3])
            if best is None or cost < best[0]:
                best = (cost, rect)
            if cost == 0:
                break
        assert best is not None
        blocked.append(best[1])
        placed.append(best[1])
    return placed


def reference_points(points: Any) -> list[tuple[float, float, float]]:
    """(TPF, accuracy, eps) of an oracle study's reference curve (``summary.reference``), its envelope
    in TPF order; points with a non-finite or out-of-range value are dropped (a tampered store)."""
    from dlm_toolkit.evaluation.stats import envelope

    good = []
    for p in points or []:
        try:
            t, a, e = float(p["tpf"]), float(p["accuracy"]), float(p["eps"])
        except (KeyError, TypeError, ValueError):
            continue
        if math.isfinite(t) and math.isfinite(e) and 0.0 <= a <= 1.0:
            good.append({"tpf": t, "accuracy": a, "eps": e})
    eps = {(p["tpf"], p["accuracy"]): p["eps"] for p in good}
    return [(t, a, eps[(t, a)]) for t, a in envelope(good)]


def _star(x: float, y: float, r: float) -> str:
    pts = [(x + (r if k % 2 == 0 else r * 0.45) * math.sin(k * math.pi / 5),
            y - (r if k % 2 == 0 else r * 0.45) * math.cos(k * math.pi / 5)) for k in range(10)]
    return " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)


def front_svg(summary: Any, runs: Mapping[int, str] | None = None) -> tuple[str, list[dict[str, Any]], list[int]]:
    """The SVG figure, the hover data of its points (in ``data-i`` order) and the trials left out."""
    runs = runs or {}
    pts, left_out = plottable(summary.points)
    on_front = {p.trial for p in summary.front}
    groups: dict[str, list[Any]] = {"front": [], "dominated": [], "presets": []}
    for p in sorted(pts, key=lambda p: (float(p.metrics["tpf"]), p.trial)):
        groups["front" if p.trial in on_front else "dominated"].append(p)
        if p.preset:
            groups["presets"].append(p)
    ivs = {p.trial: interval(p) for p in pts}
    ref = reference_points(getattr(summary, "reference", None))
    xa = Axis.around([float(p.metrics["tpf"]) for p in pts] + [t for t, _, _ in ref], LEFT, WIDTH - RIGHT)
    ya = Axis.around([v for iv in ivs.values() for v in iv] + [a for _, a, _ in ref], HEIGHT - BOTTOM, TOP)
    out = [f'<svg id="plot" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="system-ui,sans-serif" font-size="12">',
           f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" fill="#fff" '
           'stroke="#999"/>']
    for v in xa.ticks():
        x = xa.px(v)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" stroke="#eee"/>'
                   f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{v:g}</text>')
    for v in ya.ticks():
        y = ya.px(v)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 18}" text-anchor="middle">TPF (tokens up to and '
               'including the first EOS per forward)</text>'
               f'<text transform="translate(16 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" text-anchor="middle">'
               'accuracy (bars: 95 % Wilson interval)</text>')
    xy = {p.trial: (xa.px(float(p.metrics["tpf"])), ya.px(float(p.metrics["accuracy"]))) for p in pts}
    if len(groups["front"]) > 1:  # the step line: across at the last accuracy, then down to the next
        f = [xy[p.trial] for p in groups["front"]]
        path = f"M{f[0][0]:.1f},{f[0][1]:.1f}" + "".join(f"H{x:.1f}V{y:.1f}" for x, y in f[1:])
        out.append(f'<path d="{path}" fill="none" stroke="#1565c0" stroke-width="1"/>')
    hover: list[dict[str, Any]] = []
    if ref:  # an oracle study's reference rule (dlm_toolkit.sweep.reference): dashed, no run to open
        line = " ".join(f"{xa.px(t):.1f},{ya.px(a):.1f}" for t, a, _ in ref)
        out.append(f'<polyline points="{line}" fill="none" stroke="#c62828" stroke-width="1.5" stroke-dasharray="5,3"/>')
        for t, a, eps in ref:
            x, y = xa.px(t), ya.px(a)
            hover.append({"text": f"reference rule, eps {eps:g}\naccuracy {a:.4f}, TPF {t:.3f}", "link": ""})
            out.append(f'<path class="pt" data-i="{len(hover) - 1}" data-trace="reference" data-tpf="{t!r}" '
                       f'data-accuracy="{a!r}" d="M{x - 4:.1f},{y - 4:.1f}L{x + 4:.1f},{y + 4:.1f}M{x - 4:.1f},'
                       f'{y + 4:.1f}L{x + 4:.1f},{y - 4:.1f}" stroke="#c62828" stroke-width="2"/>')
    style = {"front": 'fill="#1565c0"', "dominated": 'fill="#b0b0b0"',
             "presets": 'fill="none" stroke="#d84315" stroke-width="2"'}
    for name in ("dominated", "front", "presets"):
        for p in groups[name]:
            x, y = xy[p.trial]
            lo, hi = ivs[p.trial]
            i = len(hover)
            hover.append({"text": _hover(p, ivs[p.trial], runs.get(p.trial)), "link": runs.get(p.trial, "")})
            attrs = (f'class="pt" data-i="{i}" data-trace="{name}" data-trial="{p.trial}" '
                     f'data-tpf="{float(p.metrics["tpf"])!r}" data-accuracy="{float(p.metrics["accuracy"])!r}"')
            if name == "presets":
                out.append(f'<polygon {attrs} points="{_star(x, y, MARKER_PX[name])}" {style[name]}/>')
                continue
            color = "#1565c0" if name == "front" else "#b0b0b0"
            out.append(f'<line x1="{x:.1f}" y1="{ya.px(lo):.1f}" x2="{x:.1f}" y2="{ya.px(hi):.1f}" stroke="{color}"/>'
                       f'<circle {attrs} cx="{x:.1f}" cy="{y:.1f}" r="{MARKER_PX[name]}" {style[name]}/>')
    labels = [(*xy[p.trial], cut_text(p.preset, 40)) for p in groups["presets"]]
    markers = [(*xy[p.trial], MARKER_PX[n] + 2) for n in TRACES for p in groups[n]]
    for (x, y, text), (x0, y0, x1, y1) in zip(labels, place(labels, markers, (LEFT, TOP, WIDTH - RIGHT, HEIGHT - BOTTOM))):
        cx, cy = min(max(x, x0), x1), min(max(y, y0), y1)  # the label box's nearest point to its star
        if math.hypot(cx - x, cy - y) > MARKER_PX["presets"] + 12:  # a label moved off its star
            out.append(f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{cx:.1f}" y2="{cy:.1f}" stroke="#d84315" stroke-width="0.7"/>')
        out.append(f'<text class="label" x="{x0 + 2:.1f}" y="{y1 - 3:.1f}" font-family="monospace" '
                   f'font-size="{LABEL_FONT_PX}" fill="#bf360c">{html.escape(text)}</text>')
    out.append("</svg>")
    return "".join(out), hover, left_out


CSS = """
body{font-family:system-ui,sans-serif;margin:12px;color:#222;background:#fff}
h1{font-size:15px;margin:0 0 6px}
.note{font-size:12px;color:#b71c1c;margin:0 0 6px}
.legend span{margin-right:14px;font-size:12px}
.pt{cursor:pointer}
#tip{position:fixed;display:none;background:#222;color:#fff;font:12px monospace;padding:4px 6px;border-radius:3px;
 pointer-events:none;z-index:9;white-space:pre}
"""

# Hover shows the point's text (as text, never markup); a click opens its MLflow run in a new tab.
JS = r"""
(function(){
"use strict";
const H = JSON.parse(document.getElementById("front-data").textContent), tip = document.getElementById("tip");
document.addEventListener("mouseover", (e) => {
  const p = e.target.closest ? e.target.closest(".pt") : null;
  if (!p){ tip.style.display = "none"; return; }
  tip.textContent = H[+p.dataset.i].text; tip.style.display = "block";
  const r = p.getBoundingClientRect(); tip.style.left = (r.right + 6) + "px"; tip.style.top = (r.top) + "px";
});
document.addEventListener("click", (e) => {
  const p = e.target.closest ? e.target.closest(".pt") : null;
  if (p && H[+p.dataset.i].link) window.open(H[+p.dataset.i].link, "_blank", "noopener");
});
})();
"""


def front_page(summary: Any, runs: Mapping[int, str] | None = None) -> str:
    """``pareto.html`` as text. ``runs``: trial number -> its MLflow run page."""
    svg, hover, left_out = front_svg(summary, runs)
    title = html.escape(cut_text(f"{summary.study_name}: accuracy vs TPF (hover a point; click opens its run)", 300))
    note = (f'<p class="note">left out, metrics not finite or out of range: trials '
            f'{html.escape(", ".join(map(str, left_out[:20])))}{" ..." if len(left_out) > 20 else ""}</p>'
            if left_out else "")
    ref_legend = ('<span style="color:#c62828">&#10005; reference rule (oracle joint, eps sweep)</span>'
                  if reference_points(getattr(summary, "reference", None)) else "")
    return valid_utf8(f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><link rel="icon" href="data:,">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'">
<title>{title}</title><style>{CSS}</style></head><body>
<h1>{title}</h1>{note}
<div class="legend"><span style="color:#1565c0">&#9679; on the front</span><span style="color:#888">&#9679; dominated</span>
<span style="color:#d84315">&#9734; presets</span>{ref_legend}<span>bars: 95 % Wilson interval of the accuracy</span></div>
{svg}<div id="tip"></div>
<script type="application/json" id="front-data">{script_json(hover)}</script>
<script>{JS}</script>
</body></html>
""")


def write_front(summary: Any, path: str | Path, runs: Mapping[int, str] | None = None) -> Path:
    """Write ``pareto.html`` atomically; returns its path."""
    path = Path(path)
    write_text(path, front_page(summary, runs))
    return path
