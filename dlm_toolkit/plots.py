"""Figures people would rather look at than read: decode trajectories."""

from __future__ import annotations

from typing import Any

from dlm_toolkit.trajectory import Trajectory


def plot_trajectory(trajectory: Trajectory, row: int = 0, ax: Any = None, block_length: int | None = None, title: str | None = None) -> Any:
    """Which position was committed (dot), edited (cross) or remasked (triangle) at which forward,
    coloured by the confidence of the written token; post steps are shaded.

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
        for positions, marker, size in ((s.commit, "o", 18), (s.edit, "x", 30), (s.remask, "v", 24)):
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
    ax.set_title(title or f"row {row}: o commit (M2T)  x edit (T2T)  v remask  grey = post step", fontsize=10)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(sm, ax=ax, label="confidence")
    fig.tight_layout()
    return fig
