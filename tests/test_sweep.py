"""Sweeps: experiment validation, real Optuna studies (SQLite in tmp) logged in real MLflow (SQLite in tmp).

The model is a tiny random LLaDA2 checkpoint (accuracy ~0): these tests check the mechanics —
trials, presets, resume, failures, pruning, tracking, replay — and the front on hand-made points.
Process-level behaviour (kill -9 and resume, two workers) is in test_sweep_processes.py.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest
from optuna.trial import TrialState

from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.strategy.policy_config import load_policy
from dlm_toolkit.sweep.attrs import read_settings
from dlm_toolkit.sweep.experiment import load_experiment
from dlm_toolkit.sweep.pareto import (
    TrialPoint,
    dominates,
    format_table,
    front_auc,
    hypervolume_2d,
    non_dominated,
    summarize,
    summarize_points,
    write_all,
)
from dlm_toolkit.sweep.params import trial_policy
from dlm_toolkit.sweep.storage import load_study
from dlm_toolkit.sweep.study import run_sweep

import sweep_helpers as h
from sweep_helpers import restore_torch_threads  # noqa: F401

pytestmark = pytest.mark.usefixtures("restore_torch_threads")

FLAT_METRICS = {"accuracy", "tpf", "nfe_mean", "wall_time_s", "edits_per_token", "tokens_per_second"}


# -- the front on hand-made points ---------------------------------------------------------------
def test_front_hypervolume_auc_and_preset_dominance_on_hand_made_points(tmp_path):
    mm = ("maximize", "maximize")
    assert dominates((0.5, 2.0), (0.4, 2.0), mm) and not dominates((0.5, 2.0), (0.5, 2.0), mm)
    assert dominates((0.5, 1.0), (0.5, 2.0), ("maximize", "minimize"))
    # (accuracy, tpf): 0..3 form the front; 4 is dominated by 1; 5 duplicates 2 (both kept)
    acc_tpf = [(0.9, 1.0), (0.8, 2.0), (0.5, 3.0), (0.2, 4.0), (0.7, 1.5), (0.5, 3.0)]
    assert non_dominated(acc_tpf, mm) == [0, 1, 2, 3, 5]
    # staircase area with reference (0, 0): 0.9*1 + 0.8*1 + 0.5*1 + 0.2*1
    assert hypervolume_2d(acc_tpf) == pytest.approx(2.4)
    assert hypervolume_2d([(0.5, 2.0)]) == pytest.approx(1.0)
    # trapezoids through (1, .9) (2, .8) (3, .5) (4, .2)
    assert front_auc(acc_tpf) == pytest.approx(0.85 + 0.65 + 0.35)
    assert front_auc([(0.5, 2.0)]) == 0.0

    points = [TrialPoint(i, {"accuracy": a, "tpf": t}, {"m2t.params.threshold": 0.1 * i}) for i, (a, t) in enumerate(acc_tpf)]
    points[4].preset = "q"  # (0.7, 1.5)
    points.append(TrialPoint(6, {"accuracy": 0.3, "tpf": 1.0}, {}, preset="s"))
    summary = summarize_points("hand", {"accuracy": "maximize", "tpf": "maximize"}, points, preset_names=["s", "q", "x"])
    assert [p.trial for p in summary.front] == [0, 1, 2, 5, 3]  # sorted by TPF
    assert summary.dominated_by == {"q": [1], "s": [0, 1, 2, 4, 5], "x": []}
    assert summary.presets["x"] is None
    assert summary.speedup_at_quality["q"]["trial"] == 1 and summary.speedup_at_quality["q"]["ratio"] == pytest.approx(2.0 / 1.5)
    rows = {r["trial"]: r for r in summary.rows()}
    assert rows[1]["dominates_q"] is True and rows[0]["dominates_q"] is False and rows[3]["dominates_s"] is False
    assert rows[1]["dominates_x"] is None and rows[1]["params"] == {"m2t.params.threshold": 0.1}
    files = write_all(summary, tmp_path / "out")
    assert files["png"].read_bytes()[:4] == b"\x89PNG"
    csv_lines = files["csv"].read_text().splitlines()
    assert len(csv_lines) == 1 + len(points) and "on_front" in csv_lines[0]
    assert json.loads(files["json"].read_text())["hypervolume"] == pytest.approx(summary.hypervolume)
    assert "dominated by 1 trial(s) [1]" in format_table(summary)


def test_the_plot_shows_trials_that_share_a_point(tmp_path):
    """Re-proposed policies and ties land on one point: one dot, every trial number (front) or a count."""
    import matplotlib.pyplot as plt

    from dlm_toolkit.sweep.pareto import figure, stack_label

    acc_tpf = {0: (0.9, 1.0), 1: (0.5, 3.0), 2: (0.5, 3.0), 3: (0.4, 1.0), 4: (0.4, 1.0), 5: (0.4, 1.0),
               6: (0.5, 3.0), 7: (0.5, 3.0), 8: (0.5, 3.0)}
    points = [TrialPoint(i, {"accuracy": a, "tpf": t}, {}) for i, (a, t) in acc_tpf.items()]
    summary = summarize_points("stacked", {"accuracy": "maximize", "tpf": "maximize"}, points, preset_names=[])
    fig = figure(summary)
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    plt.close(fig)
    assert texts == ["0", "1,2,6 +2", "x3"]  # front: 0 and the five at (3.0, 0.5); off the front: three at (1.0, 0.4)
    assert stack_label([4, 9]) == "4,9" and stack_label([1, 2, 3, 4], most=2) == "1,2 +2"


# -- validation before anything runs ------------------------------------------------------------
BAD_EXPERIMENTS = [
    ({"bogus": 1}, "bogus"),
    ({"search_space": {"m2t.params.threshold": {"float": [0.3, 1.5]}}},
     "search_space.m2t.params.threshold: range [0.3, 1.5] is outside the allowed range of m2t rule 'threshold' field 'threshold' (0.0 < x <= 1.0)"),
    ({"search_space": {"m2t.params.treshold": {"float": [0.3, 0.9]}}}, "has no field 'treshold'"),
    ({"search_space": {"t2t.name": {"categorical": ["none", "threshold"]}, "t2t.params.threshold": {"float": [0.0, 0.9]}}},
     "t2t rule 'none' (a choice of t2t.name) has no field 'threshold'"),
    ({"search_space": {"t2t.name": {"categorical": ["none", "nope"]}}}, "unknown t2t rule 'nope'; available:"),
    ({"search_space": {"blocks.params.block_length": {"int": [0, 32]}}}, "allowed range of blocks rule 'semi_ar' field 'block_length' (1 <= x <= 4096)"),
    ({"search_space": {"m2t.params.threshold": {"float": [0.3, 0.9], "when": {"t2t.name": "threshold"}}}}, "when: 't2t.name' must be a categorical key"),
    ({"search_space": {"nonsense.key": {"float": [0, 1]}}}, "unknown key"),
    ({"sampler": "cmaes"}, "sampler.name"),
    ({"sampler": "grid"}, "grid needs a finite search space"),
    ({"task": "multiply"}, "unknown task 'multiply'; available tasks: add"),
    ({"pruning": {"rule": "median"}}, "needs exactly one objective"),
    ({"objectives": {"speed": "maximize"}}, "unknown metric 'speed'"),
    ({"presets_to_enqueue": ["llada9"]}, "unknown preset"),
]


@pytest.mark.parametrize("change, fragment", BAD_EXPERIMENTS)
def test_bad_experiment_is_a_config_error(change, fragment):
    with pytest.raises(ConfigError) as err:
        load_experiment(h.experiment(**change))
    assert fragment in str(err.value)


def test_relative_model_path_is_resolved_against_the_yaml_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    f = h.write_yaml(tmp_path / "sub" / "e.yaml", h.experiment(model="../ckpt"))
    exp = load_experiment(f)
    assert exp.model == str((tmp_path / "ckpt").resolve()) and exp.default_name == "t"
    assert exp.source == f.resolve()


@pytest.mark.parametrize(
    "change, extra, fragment",
    [
        ({"search_space": {"m2t.params.threshold": {"float": [0.3, 1.5]}}}, [], "0.0 < x <= 1.0"),
        ({"sampler": "cmaes"}, [], "sampler"),
        ({"task": "multiply"}, [], "available tasks"),
        ({"model": "/nonexistent/ckpt"}, [], "does not exist"),
        ({}, ["--storage", "postgresql://nohost/db"], "storage 'postgresql://nohost/db'"),
        ({}, ["--storage", "sqlite:///{tmp}/missing/optuna.db"], "does not exist"),
        ({}, ["--tracking-uri", "sqlite:///{tmp}/missing/mlflow.db"], "does not exist"),
        ({}, ["--set", "m2t.params.threshold=2"], "m2t.params.threshold"),
        ({}, ["--set", "foo.bar=1"], "unknown key"),
        ({"n_trials": None}, [], "n_trials"),
        ({}, ["--workers", "0"], "workers"),
    ],
)
def test_sweep_cli_bad_input_exits_2_before_anything_runs(tmp_path, capsys, change, extra, fragment):
    f = h.write_yaml(tmp_path / "e.yaml", h.experiment(**{"n_trials": 2, **change}))
    args = ["sweep", str(f), "--storage", f"sqlite:///{tmp_path}/optuna.db",
            "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--no-progress"]
    args += [a.replace("{tmp}", str(tmp_path)) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "mlflow.db").exists()  # nothing ran, nothing was tracked
    if "--storage" not in extra or "postgresql" in " ".join(extra):
        assert not (tmp_path / "optuna.db").exists() or "postgresql" in " ".join(extra)


def test_sweep_cli_subprocess_exit_code_2_without_traceback(tmp_path):
    f = h.write_yaml(tmp_path / "e.yaml", h.experiment(n_trials=2, search_space={"m2t.params.threshold": {"float": [0.0, 0.9]}}))
    proc = h.dlm("sweep", str(f), "--storage", f"sqlite:///{tmp_path}/o.db", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "m2t.params.threshold: range [0.0, 0.9] is outside the allowed range" in proc.stderr
    assert not (tmp_path / "o.db").exists()


# -- a real sweep --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """One in-process sweep of 5 trials (2 presets + 3 random), then the same command again."""
    tmp = tmp_path_factory.mktemp("sweep")
    exp = load_experiment(h.write_yaml(tmp / "exp.yaml", h.experiment()))
    storage, uri = f"sqlite:///{tmp}/optuna.db", h.tracking_uri(tmp)
    first = run_sweep(exp, 5, storage=storage, tracking_uri=uri, progress=False, heartbeat_interval=2, threads=1)
    again = run_sweep(exp, 5, storage=storage, tracking_uri=uri, progress=False, heartbeat_interval=2, threads=1)
    return {"tmp": tmp, "exp": exp, "storage": storage, "uri": uri, "first": first, "again": again}


def test_sweep_trials_presets_and_policies(swept):
    study = load_study(swept["storage"], "t")
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5  # the rerun added nothing
    assert swept["first"].complete and swept["again"].counts.counted == 5
    assert [t.user_attrs.get("preset") for t in trials] == ["llada2.1-s", "llada2.1-q", None, None, None]
    assert study.user_attrs["presets_enqueued"] == ["llada2.1-s", "llada2.1-q"]
    for t, name in zip(trials, ["llada2.1-s", "llada2.1-q"]):
        assert t.user_attrs["policy"] == load_policy(name).canonical_json()
    for t in trials[2:]:
        policy = trial_policy(swept["exp"], t.params)
        assert t.user_attrs["policy"] == policy.canonical_json()
        assert t.user_attrs["policy_hash"] == policy.config_hash()
        assert policy.m2t.params["threshold"] == t.params["m2t.params.threshold"]
        if t.params["t2t.name"] == "none":
            assert policy.t2t.name == "none" and "t2t.params.threshold" not in t.params
        else:
            assert policy.t2t.params["threshold"] == t.params["t2t.params.threshold"]
    for t in trials:
        assert set(t.user_attrs["metrics"]) >= FLAT_METRICS and t.values == [t.user_attrs["metrics"]["accuracy"], t.user_attrs["metrics"]["tpf"]]
    settings = read_settings(study)
    # optuna-dashboard cuts attributes at 1,024 characters: none may be longer
    long = [k for k, v in study.user_attrs.items() if len(json.dumps(v)) > 1024]
    long += [f"trial {t.number} {k}" for t in trials for k, v in t.user_attrs.items() if len(json.dumps(v)) > 1024]
    assert study.user_attrs["experiment.parts"] >= 2 and long == [], long
    assert settings["n"] == 8 and settings["model"] == str(h.checkpoint()) and settings["base_policy"]["m2t"]["name"] == "threshold"


def test_sweep_mlflow_runs_params_metrics_tags_artifacts(swept, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(swept["uri"])
    runs = h.runs(swept["uri"])
    parents = [r for r in runs if r.data.tags.get("kind") == "study"]
    children = [r for r in runs if r.data.tags.get("kind") == "trial"]
    assert len(parents) == 1 and len(children) == 5  # the rerun found the parent again
    parent = parents[0]
    assert parent.info.status == "FINISHED" and parent.data.tags["study_name"] == "t"
    assert parent.data.tags["storage"] == swept["storage"] and parent.info.run_id == swept["first"].parent_run_id
    assert {"pareto.png", "pareto.csv", "pareto.json", "experiment.json", "exp.yaml"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"front_size", "n_complete", "hypervolume", "auc"} <= set(parent.data.metrics)
    space = json.loads(parent.data.params["search_space"])  # the keys with their ranges
    assert space["m2t.params.threshold"]["float"] == [0.3, 0.99] and space["t2t.name"]["categorical"] == ["none", "threshold"]
    assert space["blocks.params.block_length"]["categorical"] == [8, 16, 32]  # numbers ascending, names as written
    study = load_study(swept["storage"], "t")
    by_number = {t.number: t for t in study.get_trials()}
    front = {p.trial for p in summarize(study).front}
    import dlm_toolkit

    assert {t.distributions["blocks.params.block_length"].choices for t in by_number.values()} == {(8, 16, 32)}
    for run in children:
        t = by_number[int(run.data.tags["trial_number"])]
        assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.run_id == t.user_attrs["mlflow_run_id"]
        tags = run.data.tags
        assert tags["policy_hash"] == t.user_attrs["policy_hash"] and tags["study_name"] == "t"
        assert tags["dlm_toolkit_version"] == dlm_toolkit.__version__ and tags["seed"] == "0"
        assert tags["task"] == "add" and tags["checkpoint"] == str(h.checkpoint()) and tags["trial_state"] == "COMPLETE"
        policy = load_policy(json.loads(t.user_attrs["policy"]))
        assert run.data.params == {k: str(v) for k, v in policy.flat().items()}
        assert FLAT_METRICS <= set(run.data.metrics)
        assert run.data.metrics["tpf"] == pytest.approx(t.user_attrs["metrics"]["tpf"])
        path = client.download_artifacts(run.info.run_id, "policy.json", str(tmp_path))
        assert open(path).read() == t.user_attrs["policy"]  # the canonical JSON, source of truth
        assert client.get_metric_history(run.info.run_id, "progress.accuracy_so_far")[-1].step == 8
        assert "records.jsonl" in {a.path for a in client.list_artifacts(run.info.run_id)}
        assert tags["preset"] == (t.user_attrs.get("preset") or "none")
        page = open(client.download_artifacts(run.info.run_id, "trajectory.html", str(tmp_path / run.info.run_id))).read()
        named = (f"preset {t.user_attrs['preset']}" if t.user_attrs.get("preset") else
                 f"m2t.params.threshold={t.params['m2t.params.threshold']:.4g}")  # the page says which trial it shows
        assert re.search(rf"<title>add: trial {t.number}, [^<]*{re.escape(named)}[^<]* \u00b7 {h.checkpoint().name}</title>",
                         page), re.findall("<title>.*</title>", page)
        assert tags["mlflow.note.content"].startswith(f"Trial {t.number} of study 't': ")  # the run's description
        assert tags["on_front"] == str(t.number in front).lower()
    # the parent's front metrics are a curve over trial numbers, not one dot per sweep
    steps = [m.step for m in client.get_metric_history(parent.info.run_id, "front_size")]
    assert len(steps) >= 4 and steps == sorted(steps) and steps[-1] == max(by_number)


def test_resume_adds_trials_up_to_n_and_never_reenqueues_presets(swept):
    exp, storage, uri = swept["exp"], swept["storage"], swept["uri"]
    result = run_sweep(exp, 6, storage=storage, tracking_uri=uri, progress=False, heartbeat_interval=2, threads=1)
    trials = load_study(storage, "t").get_trials()
    assert len(trials) == 6 and result.counts.counted == 6
    assert [t.user_attrs.get("preset") for t in trials].count("llada2.1-q") == 1
    assert len([r for r in h.runs(uri) if r.data.tags.get("kind") == "study"]) == 1
    with pytest.raises(ConfigError, match=r"different settings \(n: 8 -> 16\)"):
        run_sweep(load_experiment(h.experiment(n=16)), 7, storage=storage, tracking_uri=uri, progress=False, threads=1)


def test_replay_reproduces_stored_metrics(swept, capsys):
    assert main(["replay", "--storage", swept["storage"], "--study-name", "t", "--trial", "3", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["match"] and out["mismatches"] == [] and "accuracy" in out["compared"]
    stored = load_study(swept["storage"], "t").trials[3].user_attrs["metrics"]
    assert out["metrics"]["tpf"] == stored["tpf"] and out["metrics"]["nfe_mean"] == stored["nfe_mean"]
    assert main(["replay", "--storage", swept["storage"], "--study-name", "t", "--trial", "99"]) == 2
    assert "no such trial" in capsys.readouterr().err
    assert main(["replay", "--storage", swept["storage"], "--study-name", "nope", "--trial", "0"]) == 2
    assert "no study named 'nope'" in capsys.readouterr().err


def test_pareto_cli_table_json_and_logging(swept, capsys, tmp_path):
    args = ["pareto", "--storage", swept["storage"], "--study-name", "t", "--tracking-uri", swept["uri"], "--log"]
    assert main(args + ["--json", "--out", str(tmp_path / "p")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mlflow_parent_run_id"] == swept["first"].parent_run_id
    assert out["front"] and {"trial", "accuracy", "tpf", "params", "dominates_llada2.1-s", "dominates_llada2.1-q"} <= set(out["front"][0])
    assert set(out["presets"]) == {"llada2.1-s", "llada2.1-q"} and out["hypervolume_reference"] == {"accuracy": 0.0, "tpf": 0.0}
    assert (tmp_path / "p" / "pareto.png").exists() and (tmp_path / "p" / "pareto.csv").exists()
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Pareto front of study 't'" in text and "dom llada2.1-q" in text and "TPF = generated tokens" in text
    assert main(["pareto", "--storage", f"sqlite:///{tmp_path}/none.db", "--study-name", "t"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_trials_store_outcomes_and_the_front_marks_ties(swept, capsys):
    from dlm_toolkit.sweep.pareto import decode_outcomes, summarize
    from dlm_toolkit.evaluation.stats import mcnemar_exact

    study = load_study(swept["storage"], "t")
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    for t in done:
        bits = decode_outcomes(t.user_attrs["outcomes"])
        assert len(bits) == t.user_attrs["metrics"]["n"] and sum(bits) / len(bits) == t.user_attrs["metrics"]["accuracy"]
        assert len(t.user_attrs["outcomes"]) <= 1024
    summary = summarize(study)
    q = summary.presets["llada2.1-q"]
    for p in summary.front:
        a, b = decode_outcomes(p.outcomes), decode_outcomes(q.outcomes)
        pval = mcnemar_exact(sum(x and not y for x, y in zip(a, b)), sum(y and not x for x, y in zip(a, b)))
        want = None if p.trial == q.trial or pval < 0.05 else pval
        assert summary.ties(p)["llada2.1-q"] == want
    row = summary.rows()[0]
    assert {"tied_accuracy llada2.1-q", "tied_accuracy llada2.1-s"} <= set(row)


def test_outcomes_round_trip_and_ties_by_hand():
    from dlm_toolkit.sweep.pareto import TrialPoint, decode_outcomes, encode_outcomes, tied_accuracy

    scores = [1, 0, 0.5, 0.49, 1, 1, 0, 0, 0, 1, 1]
    assert decode_outcomes(encode_outcomes(scores)) == [s >= 0.5 for s in scores]
    assert decode_outcomes(encode_outcomes([0.0] * 5)) == [False] * 5 and decode_outcomes(encode_outcomes([])) == []
    assert len(encode_outcomes([1.0] * 256)) <= 70
    a = TrialPoint(0, {}, outcomes=encode_outcomes([1] * 20))
    b = TrialPoint(1, {}, outcomes=encode_outcomes([1] * 14 + [0] * 6))  # 6 discordant, all for a: p = 2/64
    c = TrialPoint(2, {}, outcomes=encode_outcomes([1] * 18 + [0] * 2))  # 2 discordant: p = 0.5
    assert tied_accuracy(a, b) is None and tied_accuracy(a, c) == 0.5
    assert tied_accuracy(a, TrialPoint(3, {}, outcomes=encode_outcomes([1] * 10))) is None  # other instances
    assert tied_accuracy(a, TrialPoint(4, {})) is None


# -- failures and pruning ------------------------------------------------------------------------
BOOM = '''
from pydantic import Field
from dlm_toolkit import StrategyConfig, UnmaskRule

class BoomUnmask(UnmaskRule):
    """Validates like `threshold` but raises when called."""
    class Config(StrategyConfig):
        threshold: float = Field(0.9, gt=0.0, le=1.0)

    def __call__(self, ctx):
        raise RuntimeError(f"boom: deliberately failing rule (threshold {self.config.threshold:.2f})")
'''


def test_failing_policy_is_recorded_and_the_sweep_continues(tmp_path, monkeypatch):
    (tmp_path / "sweep_boom_rule.py").write_text(textwrap.dedent(BOOM))
    monkeypatch.syspath_prepend(str(tmp_path))
    space = {"m2t.name": {"categorical": ["sweep_boom_rule:BoomUnmask"]}, "m2t.params.threshold": {"float": [0.3, 0.9]}}
    with pytest.raises(ConfigError, match="would import module 'sweep_boom_rule'"):
        load_experiment(h.experiment(search_space=space))  # class paths need the experiment's opt-in
    assert "sweep_boom_rule" not in sys.modules
    exp = load_experiment(h.experiment(search_space=space, allow_import=True))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    result = run_sweep(exp, 4, storage=storage, tracking_uri=uri, progress=False, threads=1)
    trials = load_study(storage, "t").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2 + [TrialState.FAIL] * 2  # presets pass
    assert result.counts.counted == 4 and result.counts.failed == 2 and result.complete
    for t in trials[2:]:
        assert t.user_attrs["error"].startswith("RuntimeError: boom: deliberately failing rule")
    runs = {r.data.tags.get("trial_number"): r for r in h.runs(uri) if r.data.tags.get("kind") == "trial"}
    for n in ("2", "3"):
        assert runs[n].info.status == "FAILED" and runs[n].data.tags["trial_state"] == "FAIL"
        assert "boom: deliberately failing rule" in runs[n].data.tags["error"]
        assert runs[n].data.params["m2t.name"] == "sweep_boom_rule:BoomUnmask"  # the policy was built and logged
    assert all(r.info.status != "RUNNING" for r in h.runs(uri))


def test_threshold_pruning_with_two_objectives(tmp_path):
    exp = load_experiment(h.experiment(pruning={"rule": "threshold", "min_quality": 0.5, "after": 4},
                                       presets_to_enqueue=["llada2.1-q"]))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    result = run_sweep(exp, 3, storage=storage, tracking_uri=uri, progress=False, threads=1)
    trials = load_study(storage, "t").get_trials()
    # the preset is never pruned (reference point); the random model's accuracy is 0 < 0.5
    assert [t.state for t in trials] == [TrialState.COMPLETE] + [TrialState.PRUNED] * 2
    assert result.counts.counted == 3 and result.counts.pruned == 2
    assert all(t.user_attrs["pruned_at"]["n"] == 4 for t in trials[1:])  # after the first batch of 4
    assert [p.trial for p in result.summary.front] == [0] and result.summary.counts["pruned"] == 2
    children = {r.data.tags["trial_number"]: r for r in h.runs(uri) if r.data.tags.get("kind") == "trial"}
    assert children["0"].data.tags["trial_state"] == "COMPLETE"
    assert {(children[n].info.status, children[n].data.tags["trial_state"]) for n in "12"} == {("FINISHED", "PRUNED")}


def test_median_pruning_single_objective_reports_intermediate_values(tmp_path):
    exp = load_experiment(h.experiment(objectives={"tpf": "maximize"}, presets_to_enqueue=[],
                                       pruning={"rule": "median", "after": 1, "n_startup_trials": 1}))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    result = run_sweep(exp, 3, storage=storage, tracking_uri=uri, progress=False, threads=1)
    trials = load_study(storage, "t").get_trials()
    assert result.counts.counted == 3 and all(set(t.intermediate_values) >= {4} for t in trials)
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED}


@pytest.mark.parametrize("name", ["quickstart.yaml", "sort.yaml"])
def test_shipped_experiment_files_validate(name):
    exp = load_experiment(h.REPO / "experiments" / name)
    assert exp.model == str(h.REPO / "checkpoints" / "testbed-editable") and exp.n_trials


def test_reconcile_never_kills_a_run_that_finishes_while_it_looks(tmp_path):
    """Another worker finishes trial 0 between reconcile's two reads (its run closes first, then
    Optuna marks the trial COMPLETE): the run must stay FINISHED. Killed trials still get closed."""
    import optuna

    from dlm_toolkit.sweep.tracking import Tracker

    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    study = optuna.create_study(storage=storage, study_name="t", directions=["maximize"])
    tracker = Tracker(uri, "dlm-sweep")
    parent = tracker.parent_run("t", storage, {}, None)
    live, dead = study.ask(), study.ask()
    runs = {t.number: tracker.start_trial(parent, "t", storage, t.number, {}) for t in (live, dead)}
    study.tell(dead, state=TrialState.FAIL)  # its process died: the heartbeat failed it
    real_search = tracker.client.search_runs

    def search_then_the_other_worker_finishes(*args, **kwargs):
        found = real_search(*args, **kwargs)
        runs[live.number].finish("FINISHED", "COMPLETE", {"accuracy": 1.0})
        study.tell(live, [1.0])
        return found

    tracker.client.search_runs = search_then_the_other_worker_finishes
    closed = tracker.reconcile(study, storage)
    assert closed == [runs[dead.number].run_id]
    status = {n: tracker.client.get_run(r.run_id).info.status for n, r in runs.items()}
    assert status == {live.number: "FINISHED", dead.number: "KILLED"}


def test_a_repeated_policy_is_evaluated_once_and_tagged_duplicate_of(tmp_path, monkeypatch):
    import dlm_toolkit.evaluation.evaluate as evaluate_module

    calls = []
    real = evaluate_module.evaluate

    def counting(model, tokenizer, task, policy, *args, **kwargs):
        calls.append(policy.config_hash())
        return real(model, tokenizer, task, policy, *args, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate", counting)
    space = {"blocks.params.block_length": {"categorical": [8, 16]}}  # 2 policies, 7 trials
    exp = load_experiment(h.experiment(search_space=space, presets_to_enqueue=[]))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    result = run_sweep(exp, 7, storage=storage, tracking_uri=uri, progress=False, threads=1)
    trials = load_study(storage, "t").get_trials()
    assert result.counts.counted == 7 and all(t.state == TrialState.COMPLETE for t in trials)
    hashes = {t.user_attrs["policy_hash"] for t in trials}
    assert sorted(calls) == sorted(hashes)  # one evaluation per distinct policy
    originals = {t.user_attrs["policy_hash"]: t for t in trials if t.user_attrs.get("duplicate_of") is None}
    assert len(originals) == len(hashes)
    for t in trials:
        first = originals[t.user_attrs["policy_hash"]]
        if t is not first:
            assert t.user_attrs["duplicate_of"] == first.number and t.values == first.values
            assert t.user_attrs["metrics"] == first.user_attrs["metrics"]
    tagged = {int(r.data.tags["trial_number"]): r.data.tags.get("duplicate_of") for r in h.runs(uri)
              if r.data.tags.get("kind") == "trial"}
    assert tagged == {t.number: (None if t.user_attrs.get("duplicate_of") is None
                                 else str(t.user_attrs["duplicate_of"])) for t in trials}
    assert len(result.summary.points) == len(hashes) and result.summary.counts["duplicates"] == 7 - len(hashes)


def test_settings_split_into_attributes_under_1kb_round_trip():
    import optuna

    from dlm_toolkit.sweep.attrs import stored_settings, write_settings

    study = optuna.create_study()
    settings = {"quotes": '"' * 1500, "backslashes": "\\" * 700, "text": "é" * 900, "nested": {"k": list(range(400))}}
    write_settings(study, settings)
    assert stored_settings(study) == settings
    assert all(len(json.dumps(v)) <= 1024 for v in study.user_attrs.values())
    write_settings(study, {"small": 1})  # rewritten with fewer parts: stale parts are not read
    assert stored_settings(study) == {"small": 1}
    legacy = optuna.create_study()
    legacy.set_user_attr("experiment", {"n": 8})  # a study from before the split
    assert stored_settings(legacy) == {"n": 8} and read_settings(optuna.create_study()) is None
    exp = load_experiment(h.experiment())
    write_settings(study, exp.settings())
    assert read_settings(study) == exp.settings()  # validated by the experiment schema on the way back


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_reconcile_kills_the_run_of_a_trial_that_died_after_closing_it(tmp_path):
    """A worker closes its run (COMPLETE), then dies before Optuna stores the result: the heartbeat
    fails the trial and queues a retry, and the run must not keep claiming COMPLETE."""
    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    from dlm_toolkit.sweep.tracking import Tracker

    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    study = optuna.create_study(storage=storage, study_name="t", directions=["maximize"])
    tracker = Tracker(uri, "dlm-sweep")
    parent = tracker.parent_run("t", storage, {}, None)
    died, fine = study.ask(), study.ask()
    runs = {}
    for t in (died, fine):
        runs[t.number] = tracker.start_trial(parent, "t", storage, t.number, {})
        t.set_user_attr("mlflow_run_id", runs[t.number].run_id)
        runs[t.number].finish("FINISHED", "COMPLETE", {"accuracy": 1.0})
    study.tell(fine, [1.0])
    study.tell(died, state=TrialState.FAIL)  # what the heartbeat does to a dead worker's trial ...
    RetryHeartbeatStaleTrialCallback(max_retry=3)(study, study.trials[died.number])  # ... and its retry
    assert tracker.reconcile(study, storage) == [runs[died.number].run_id]
    run = tracker.client.get_run(runs[died.number].run_id)
    assert run.info.status == "KILLED" and run.data.tags["trial_state"] == "KILLED"
    assert "retried as trial 2" in run.data.tags["killed_reason"]
    assert tracker.client.get_run(runs[fine.number].run_id).info.status == "FINISHED"
    assert tracker.reconcile(study, storage) == []  # settled once


def test_a_relative_sqlite_store_survives_moving_its_folder(tmp_path, monkeypatch):
    """``sqlite:///runs/mlflow.db`` resolves against the working folder; so do its artifacts."""
    import shutil

    from mlflow import MlflowClient

    from dlm_toolkit.evaluation.evaluate import EvalResult
    from dlm_toolkit.sweep.tracking import log_eval_run

    before, after = tmp_path / "before", tmp_path / "after"
    (before / "runs").mkdir(parents=True)
    h.tracking_uri(before / "runs")
    monkeypatch.chdir(before)
    uri = "sqlite:///runs/mlflow.db"
    policy = load_policy("llada2.1-q")
    result = EvalResult({"accuracy": 0.5, "tpf": 2.0}, [{"score": 1.0, "completion": "12"}, {"score": 0.0, "completion": "x"}])
    run_id = log_eval_run(result, policy, "add", h.checkpoint(), uri)
    assert MlflowClient(uri).get_experiment_by_name("dlm-eval").artifact_location == "runs/mlartifacts/dlm-eval"
    shutil.move(before, after)
    monkeypatch.chdir(after)
    client = MlflowClient(uri)
    assert open(client.download_artifacts(run_id, "policy.json", str(tmp_path))).read() == policy.canonical_json()
    records = open(client.download_artifacts(run_id, "records.jsonl", str(tmp_path))).read().splitlines()
    assert [json.loads(r)["completion"] for r in records] == ["12", "x"]
    # an absolute store URI keeps absolute locations (moving it breaks the URI as well)
    absolute = f"sqlite:///{after / 'runs' / 'mlflow.db'}"
    log_eval_run(result, policy, "add", h.checkpoint(), absolute, experiment_name="other")
    assert MlflowClient(absolute).get_experiment_by_name("other").artifact_location == \
        (after / "runs" / "mlartifacts" / "other").as_uri()


def test_an_unreachable_tracking_server_is_reported_once(tmp_path):
    """The first call the MLflow client gave up on raises TrackingLost; later calls raise it at once
    (no second round of retries); an answer from the server (HTTP 400) stays an ordinary error."""
    from mlflow.exceptions import MlflowException

    from dlm_toolkit.sweep.tracking import Tracker, TrackingLost

    tracker = Tracker(h.tracking_uri(tmp_path), "x")
    calls = []

    def answered():
        calls.append("answered")
        raise MlflowException("API request to endpoint /api/2.0/mlflow/runs/create failed with error code 400 != 200")

    def refused():
        calls.append("refused")
        raise MlflowException("API request to http://127.0.0.1:1/api/2.0/mlflow/runs/create failed with exception "
                              "HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded\nmore lines")

    with pytest.raises(MlflowException) as err:
        tracker._call(answered)
    assert not isinstance(err.value, TrackingLost) and tracker.lost is None
    with pytest.raises(TrackingLost, match=r"MLflow server stopped answering \(API request to http://127.0.0.1:1/"):
        tracker._call(refused)
    with pytest.raises(TrackingLost):
        tracker._call(lambda: calls.append("later"))
    assert calls == ["answered", "refused"]


def _unique_violation():
    """The exception MLflow's SQL store raises when a concurrent writer inserted the row first: a real
    sqlalchemy IntegrityError from a real unique key, wrapped as ``ManagedSessionMaker`` wraps it."""
    import sqlalchemy
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST

    engine = sqlalchemy.create_engine("sqlite://")
    with engine.begin() as con:
        con.exec_driver_sql("create table tags (key text, run_uuid text, value text, primary key (key, run_uuid))")
        con.exec_driver_sql("insert into tags values ('on_front', 'r', 'true')")
    try:
        with engine.begin() as con:
            con.exec_driver_sql("insert into tags values ('on_front', 'r', 'false')")
    except sqlalchemy.exc.IntegrityError as err:
        return MlflowException(message=err, error_code=BAD_REQUEST)
    raise AssertionError("no unique violation")


def test_a_tag_written_by_two_workers_at_once_is_retried(tmp_path):
    """Two sweeps ending together both tag ``on_front`` on the same runs; MLflow's set_tag reads then
    inserts, so the slower one hits the unique key (seen in CI on PostgreSQL). The same call again
    updates the row; a clash that persists is raised after two retries; an existing experiment name
    (a real conflict) is raised at once."""
    from mlflow.exceptions import MlflowException

    from dlm_toolkit.sweep.tracking import Tracker

    tracker = Tracker(h.tracking_uri(tmp_path), "x")
    run_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    calls = []

    def set_tag_losing_once(value):
        calls.append(value)
        if len(calls) == 1:
            tracker.client.set_tag(run_id, "on_front", "false")  # the other worker wins the insert
            raise _unique_violation()
        tracker.client.set_tag(run_id, "on_front", value)

    tracker._call(set_tag_losing_once, "true")
    assert calls == ["true", "true"]
    assert tracker.client.get_run(run_id).data.tags["on_front"] == "true"

    calls.clear()

    def always_clashing():
        calls.append(1)
        raise _unique_violation()

    with pytest.raises(MlflowException, match="IntegrityError"):
        tracker._call(always_clashing)
    assert len(calls) == 3
    calls.clear()

    def existing_name():
        calls.append(1)
        tracker.client.create_experiment("x")

    with pytest.raises(MlflowException, match="already exists"):
        tracker._call(existing_name)
    assert calls == [1]
