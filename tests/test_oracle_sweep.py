"""The reference front of an oracle sweep (dlm_toolkit/sweep/reference.py): the envelope, the gaps a
trial records, the curve stored once per study, and pareto.png drawing it."""

from __future__ import annotations

import re

from types import SimpleNamespace

import pytest

from dlm_toolkit.sweep.reference import (EPS_GRID, REFERENCE_ATTR, accuracy_at_tpf, envelope, reference_gaps,
                                         study_reference, tpf_at_accuracy)

POINTS = [{"tpf": 1.0, "accuracy": 1.0}, {"tpf": 2.0, "accuracy": 0.5}, {"tpf": 2.0, "accuracy": 0.4},
          {"tpf": 1.5, "accuracy": 0.3}, {"tpf": 3.0, "accuracy": 0.1}]


def test_envelope_keeps_the_non_dominated_points():
    assert envelope(POINTS) == [(1.0, 1.0), (2.0, 0.5), (3.0, 0.1)]  # (1.5, 0.3) and (2, 0.4) are dominated


def test_interpolation_inside_the_range_and_none_outside():
    assert accuracy_at_tpf(POINTS, 1.5) == pytest.approx(0.75)
    assert accuracy_at_tpf(POINTS, 3.0) == pytest.approx(0.1)
    assert accuracy_at_tpf(POINTS, 0.99) is None and accuracy_at_tpf(POINTS, 3.01) is None
    assert tpf_at_accuracy(POINTS, 0.75) == pytest.approx(1.5)
    assert tpf_at_accuracy(POINTS, 0.3) == pytest.approx(2.5)
    assert tpf_at_accuracy(POINTS, 0.09) is None and tpf_at_accuracy(POINTS, 1.0) == pytest.approx(1.0)


def test_gaps_are_the_reference_minus_the_trial():
    gaps = reference_gaps(POINTS, {"tpf": 1.5, "accuracy": 0.6})
    assert gaps == pytest.approx({"ref_accuracy_gap": 0.75 - 0.6, "ref_tpf_gap": 1.8 - 1.5})
    assert reference_gaps(POINTS, {"tpf": 5.0, "accuracy": 0.05}) == {}  # outside both ranges: no gap


class FakeStudy:
    def __init__(self):
        self.user_attrs = {}

    def set_user_attr(self, key, value):
        self.user_attrs[key] = value


def test_the_curve_is_computed_once_per_study_and_only_for_an_oracle():
    from dlm_toolkit.evaluation.evaluate import load_checkpoint
    from dlm_toolkit.tasks import get_task
    from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits

    exp = SimpleNamespace(n=40, seed=0, batch_size=40, base_policy={
        "m2t": {"name": "threshold"}, "t2t": {"name": "none"}, "remask": {"name": "none"},
        "blocks": {"name": "semi_ar", "params": {"block_length": 5, "max_post_steps": 0, "align": "prompt"}},
        "sampling": {"temperature": 1.0}})
    study = FakeStudy()
    assert study_reference(study, ScriptedLM(mixing_logits(24), 24, 23, 22), None, None, exp) is None
    model, tok = load_checkpoint("oracle:list_shuffle")
    task = get_task("list_shuffle", n_items=4)
    curve = study_reference(study, model, tok, task, exp)
    assert [p["eps"] for p in curve] == list(EPS_GRID) and study.user_attrs[REFERENCE_ATTR] == curve
    assert curve[0]["accuracy"] == 1.0 and curve[0]["tpf"] == pytest.approx(5 / 4)  # one item a forward (EOS with the first)
    assert curve[-1]["tpf"] == pytest.approx(5.0) and curve[-1]["accuracy"] < 0.3  # all at once: 4!/4^4 = 0.094
    calls = model.calls
    assert study_reference(study, model, tok, task, exp) == curve and model.calls == calls  # stored: no decode


def test_pareto_png_draws_the_reference_curve():
    import matplotlib.pyplot as plt

    from dlm_toolkit.sweep.pareto import TrialPoint, figure, summarize_points

    points = [TrialPoint(0, {"accuracy": 0.5, "tpf": 1.5, "n": 10}, {}, None, "a", None)]
    summary = summarize_points("s", {"accuracy": "maximize", "tpf": "maximize"}, points)
    without = figure(summary)
    summary.reference = POINTS
    drawn = figure(summary)
    try:
        labels = [t.get_text() for t in drawn.axes[0].get_legend().get_texts()]
        assert "reference rule (oracle joint, eps sweep)" in labels
        assert "reference rule (oracle joint, eps sweep)" not in [t.get_text() for t in without.axes[0].get_legend().get_texts()]
    finally:
        plt.close(drawn)
        plt.close(without)


def test_the_oracle_experiment_loads_and_offers_the_catalogue_plus_the_reference():
    from pathlib import Path

    import yaml

    from dlm_toolkit.sweep.experiment import load_experiment

    folder = Path(__file__).resolve().parents[1] / "experiments"
    exp = load_experiment(folder / "oracle.yaml")
    assert exp.model == "oracle:list_shuffle" and exp.task == "list_shuffle"  # not resolved as a path
    catalogue = yaml.safe_load((folder / "catalogue.yaml").read_text())["search_space"]["m2t.name"]["categorical"]
    offered = exp.search_space["m2t.name"].categorical
    assert set(offered) == set(catalogue) | {"reference"}


def test_pareto_html_draws_the_reference_curve_only_for_an_oracle_study():
    from dlm_toolkit.sweep.pareto import TrialPoint, summarize_points
    from dlm_toolkit.viewer.front import front_page, front_svg

    points = [TrialPoint(0, {"accuracy": 0.5, "tpf": 1.5, "n": 10}, {}, None, "a", None)]
    summary = summarize_points("s", {"accuracy": "maximize", "tpf": "maximize"}, points)
    assert 'data-trace="reference"' not in front_svg(summary)[0] and "reference rule" not in front_page(summary)
    summary.reference = [{**p, "eps": 0.1 * i} for i, p in enumerate(POINTS)]
    svg, hover, _ = front_svg(summary)
    drawn = re.findall(r'data-trace="reference" data-tpf="([^"]+)" data-accuracy="([^"]+)"', svg)
    assert [(float(t), float(a)) for t, a in drawn] == envelope(POINTS)
    assert [h["link"] for h in hover if h["text"].startswith("reference rule")] == [""] * len(drawn)  # no run to open
    assert "reference rule (oracle joint, eps sweep)" in front_page(summary)
    summary.reference = [{"tpf": float("nan"), "accuracy": 0.5, "eps": 0.1}]  # a tampered store: nothing drawn
    assert 'data-trace="reference"' not in front_svg(summary)[0]
