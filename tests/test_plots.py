from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.plots import plot_trajectory
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
