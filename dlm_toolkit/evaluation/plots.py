"""Figures people would rather look at than read: decode trajectories, and labels that never cover
one another or a marker (:func:`place_labels`, used by the Pareto figure)."""

from __future__ import annotations

from typing import Any

from dlm_toolkit.step.trajectory import Trajectory


def plot_trajectory(trajectory: Trajectory, row: int = 0, ax: Any = None, block_length: int | None = None, title: str | None = None) -> Any:
    """Which position was committed (dot), edited (cross) or remasked (triangle) at which forward,
    coloured by the confidence of the written token; post steps are shaded. Insert/delete edits
    (:mod:`dlm_toolkit.hooks.indel`) are a plus (a mask put before the position) and a diamond (the
    token there deleted), at the positions before the shift.

    Returns the matplotlib ``Figure``.
    """
    import matplotlib.pyplot as plt  # matplotlib picks a headless backend by itself when there is no display

    steps = trajectory.for_row(row)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * len(steps) + 2), 4.5))
    else:
        fig = ax.figure
    cmap = plt.get_cmap("viridis")
    for i, s in enumerate(steps):
        conf = dict(zip(s.positions, s.confidence))
        if s.post:
            ax.axvspan(i - 0.5, i + 0.5, color="0.92", zorder=0)
        for positions, marker, size in ((s.commit, "o", 18), (s.edit, "x", 30), (s.remask, "v", 24),
                                        (s.insert, "P", 40), (s.delete, "D", 26)):
            if positions:
                ax.scatter([i] * len(positions), positions, c=[conf[p] for p in positions], cmap=cmap,
                           vmin=0, vmax=1, marker=marker, s=size, zorder=2)
    if block_length and steps:
        lo = min(p for s in steps for p in s.positions)
        hi = max(p for s in steps for p in s.positions) + 1
        for b in range(lo - lo % block_length, hi + 1, block_length):
            ax.axhline(b - 0.5, color="0.6", lw=0.6, zorder=1)
    ax.invert_yaxis()
    ax.set_xlabel("forward (NFE)")
    ax.set_ylabel("canvas position")
    shifts = any(st.insert or st.delete for st in steps)
    legend = "o commit (M2T)  x edit (T2T)  v remask" + ("  + insert  ◆ delete" if shifts else "")
    ax.set_title(title or f"row {row}: {legend}  grey = post step", fontsize=10)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(sm, ax=ax, label="confidence")
    fig.tight_layout()
    return fig


# Offsets (points) tried in turn for a label, nearest first: right, above, left, below, then diagonals.
_OFFSETS = [(dx * r, dy * r) for r in (6, 14, 24, 36) for dx, dy in
            ((1, 0.4), (0.3, 1), (-1, 0.4), (0.3, -1.6), (1, -1.2), (-1, -1.2), (-1, 1), (1, 1))]


def place_labels(ax: Any, labels: list[tuple[float, float, str, dict]], markers: list[tuple[float, float]],
                 marker_radius: float = 6.0) -> list[Any]:
    """Annotate each ``(x, y, text, text_kwargs)`` in data coordinates at the first offset where the
    label overlaps no label placed before it, no marker (``markers``, in data coordinates, each a
    square of ``marker_radius`` points around it) and not the legend, and stays inside the axes; where
    none is free, at the offset with the least overlap. Call it after the legend and ``tight_layout``
    (the layout it measures). Returns the annotations."""
    fig = ax.figure
    fig.canvas.draw()  # text extents need a renderer
    renderer = fig.canvas.get_renderer()
    to_px = fig.dpi / 72.0
    box = ax.get_window_extent(renderer)
    pad = marker_radius * to_px
    centres = ax.transData.transform(markers) if markers else []
    blocked = [(px - pad, py - pad, px + pad, py + pad) for px, py in centres]
    legend = ax.get_legend()
    if legend is not None:  # drawn already: its box is taken
        e = legend.get_window_extent(renderer)
        blocked.append((e.x0, e.y0, e.x1, e.y1))
    placed = []
    for x, y, text, kwargs in labels:
        best = None
        for dx, dy in _OFFSETS:
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy), **kwargs)
            e = note.get_window_extent(renderer)
            rect = (e.x0, e.y0, e.x1, e.y1)
            cost = sum(rect_overlap(rect, other) for other in blocked)
            cost += 1e6 * (e.x0 < box.x0 or e.x1 > box.x1 or e.y0 < box.y0 or e.y1 > box.y1)
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, note, rect)
            else:
                note.remove()
            if cost == 0:
                break
        assert best is not None
        blocked.append(best[2])
        placed.append(best[1])
    return placed


def rect_overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    """Area shared by two rectangles (x0, y0, x1, y1)."""
    return max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
