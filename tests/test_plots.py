import pytest

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.evaluation.plots import plot_trajectory
from dlm_toolkit.testing import tiny_llada2


def test_trajectory_plot_draws_every_commit_and_edit(tmp_path):
    res = decode(tiny_llada2(0), [[1, 2, 3, 4, 5]], DecodingPolicy("llada2.1-s", **{"blocks.params.block_length": 16}), 40, record=True)
    fig = plot_trajectory(res.trajectory, block_length=16)
    ax = fig.axes[0]
    points = sum(len(c.get_offsets()) for c in ax.collections if hasattr(c, "get_offsets"))
    row = res.rows[0]
    assert points == row.commits + row.edits + row.remasks
    fig.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_trajectory_plot_draws_inserts_and_deletes():
    from dlm_toolkit.step.state import row_seed

    eager = {"t2t.name": "indel", "t2t.params.delete_threshold": 0.3, "t2t.params.insert_threshold": 0.3,
             "t2t.params.keep_below": 0.95, "blocks.params.block_length": 4}
    res = decode(tiny_llada2(seed=1), [[5, 6, 7]], DecodingPolicy("llada2.1-q", **eager), 12, record=True,
                 seed=[row_seed(0, 0)])
    row = res.rows[0]
    assert row.inserts + row.deletes > 0, "nothing inserted or deleted: the test checks nothing"
    ax = plot_trajectory(res.trajectory, block_length=4).axes[0]
    points = sum(len(c.get_offsets()) for c in ax.collections if hasattr(c, "get_offsets"))
    assert points == row.commits + row.edits + row.remasks + row.inserts + row.deletes
    assert "delete" in ax.get_title()


def _summary(points, presets):
    from dlm_toolkit.sweep.pareto import ParetoSummary, non_dominated

    plane = [(p.metrics["accuracy"], p.metrics["tpf"]) for p in points]
    front = [points[i] for i in non_dominated(plane, ("maximize", "maximize"))]
    return ParetoSummary("labels", {"accuracy": "maximize", "tpf": "maximize"}, points, front,
                         {p.preset: p for p in points if p.preset}, {}, {}, None, None)


def _notebook_03_points():
    """The points notebook 03's sweep gave, where the preset and front labels used to collide."""
    from dlm_toolkit.sweep.pareto import TrialPoint

    xy = [(6.154, 0.78125), (2.302, 0.9375), (7.007, 0.40625), (2.105, 0.9375), (2.207, 0.9375), (2.043, 0.9375),
          (5.783, 0.8125), (6.234, 0.8125), (2.038, 0.9375), (6.234, 0.8125)]
    return [TrialPoint(i, {"tpf": x, "accuracy": y, "n": 32}, preset={0: "llada2.1-s", 1: "llada2.1-q"}.get(i))
            for i, (x, y) in enumerate(xy)]


def _random_points(seed):
    import random

    from dlm_toolkit.sweep.pareto import TrialPoint

    rng = random.Random(seed)
    return [TrialPoint(i, {"tpf": round(rng.uniform(1, 8), 2), "accuracy": round(rng.uniform(0.3, 1.0), 2), "n": 64},
                       preset={0: "llada2.1-s", 1: "llada2.1-q"}.get(i)) for i in range(12)]



@pytest.mark.parametrize("points", [_notebook_03_points(), *(_random_points(s) for s in range(4))],
                         ids=["notebook-03", *(f"random-{s}" for s in range(4))])
def test_pareto_labels_cover_no_label_and_no_marker(points):
    import matplotlib.pyplot as plt

    from dlm_toolkit.sweep.pareto import figure

    fig = figure(_summary(points, None))
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) >= 3
    for i, a in enumerate(boxes):  # text against text: matplotlib's own extents, not the placer's
        for b in boxes[i + 1:]:
            assert not a.overlaps(b), (a, b)
    for x, y in ax.transData.transform([(p.metrics["tpf"], p.metrics["accuracy"]) for p in points]):
        for t, box in zip(ax.texts, boxes):  # no label over a marker's centre (3 points around it)
            grown = box.expanded(1, 1).padded(3 * fig.dpi / 72)
            assert not grown.contains(x, y), (t.get_text(), x, y)
    plt.close(fig)
