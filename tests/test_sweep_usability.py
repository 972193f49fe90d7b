"""What a sweep user reads (issue 45 item 6): the printed MLflow links, the parent run's description
and counts, a finished sweep run again, ``dlm pareto`` reading without writing, and ``dlm strategies``
listing presets with their settings and the step hooks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import sweep_helpers as h

from dlm_toolkit.cli import main
from dlm_toolkit.commands.sweep import open_hints
from dlm_toolkit.config import ConfigError
from dlm_toolkit.sweep.experiment import load_experiment
from dlm_toolkit.sweep.study import run_sweep

ROOT = Path(__file__).resolve().parents[1]


def test_local_links_say_port_5000_is_mlflow_uis_default_and_how_to_change_it() -> None:
    local = open_hints("sqlite:///o.db", "sqlite:///m.db", "s", "1", "abc")
    assert "mlflow ui --backend-store-uri sqlite:///m.db" in local and "http://127.0.0.1:5000/#/experiments/1" in local
    assert "5000 is mlflow ui's default port; with `mlflow ui --port N` use port N" in local
    served = open_hints("sqlite:///o.db", "http://mlflow-host:8765", "s", "1", "abc")
    assert "http://mlflow-host:8765/#/experiments/1" in served  # near miss: a server's own address, no note
    assert "5000" not in served


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """5 trials over a two-value space: the 2 presets, then 3 draws of 2 policies (a repeat is certain)."""
    tmp = tmp_path_factory.mktemp("usability")
    ckpt = shutil.copytree(h.checkpoint(), tmp / "ckpt")
    exp_file = h.write_yaml(tmp / "exp.yaml", h.experiment(model=ckpt, n=4, search_space={
        "t2t.name": {"categorical": ["none", "threshold"]}}))
    exp = load_experiment(exp_file)
    storage, uri = f"sqlite:///{tmp}/optuna.db", h.tracking_uri(tmp)
    first = run_sweep(exp, 5, storage=storage, tracking_uri=uri, progress=False, heartbeat_interval=2, threads=1)
    return {"tmp": tmp, "ckpt": ckpt, "exp_file": exp_file, "exp": exp, "storage": storage, "uri": uri,
            "first": first}


def test_parent_run_counts_what_the_sweep_printed_and_has_a_description(swept) -> None:
    from mlflow import MlflowClient

    first = swept["first"]
    parent = MlflowClient(swept["uri"]).get_run(first.parent_run_id)
    distinct = len(first.summary.points)
    assert first.counts.complete == 5 and distinct < 5  # the draws repeated a policy: fewer points than trials
    assert parent.data.metrics["n_complete"] == first.counts.complete  # the sweep's "5 complete"
    assert parent.data.metrics["n_distinct_points"] == distinct
    note = parent.data.tags["mlflow.note.content"]  # MLflow's run description
    assert "`n_complete` = COMPLETE trials" in note and "`n_distinct_points`" in note and "duplicate_of" in note
    assert "task `add`" in note and str(swept["ckpt"]) in note


def test_a_finished_sweep_run_again_answers_from_the_stores(swept, capsys) -> None:
    """The answer comes before the model is touched: with the checkpoint moved away the rerun still
    reports the study; asking for one more trial (the near miss) needs the model and says so."""
    moved = swept["ckpt"].rename(swept["tmp"] / "ckpt-away")
    try:
        args = ["sweep", str(swept["exp_file"]), "--storage", swept["storage"], "--tracking-uri", swept["uri"],
                "--no-progress", "--n-trials", "5"]
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "5/5 finished trials (5 complete, 0 pruned, 0 failed) -- already finished, nothing ran" in out
        assert f"/runs/{swept['first'].parent_run_id}" in out  # the same parent run's link
        with pytest.raises(ConfigError, match="checkpoint folder .* does not exist"):
            run_sweep(swept["exp"], 6, storage=swept["storage"], tracking_uri=swept["uri"], progress=False)
    finally:
        moved.rename(swept["ckpt"])


def _bytes(path: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_pareto_reads_by_default_and_logs_with_log(swept, capsys) -> None:
    db = Path(swept["uri"].removeprefix("sqlite:///"))
    before = _bytes(db.parent)
    args = ["pareto", "--storage", swept["storage"], "--study-name", "t", "--tracking-uri", swept["uri"]]
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mlflow_parent_run_id"] is None
    assert _bytes(db.parent) == before  # the MLflow store and its artifacts, byte for byte
    assert main(args + ["--no-log"]) == 0  # still accepted, with a note
    assert "--no-log is deprecated and will be removed in 0.3.0" in capsys.readouterr().err
    assert _bytes(db.parent) == before
    assert main(args + ["--log"]) == 0
    assert f"logged pareto.png/.csv/.json and metrics to MLflow run {swept['first'].parent_run_id}" in capsys.readouterr().out
    assert main(args + ["--log", "--no-log"]) == 2


def test_presets_are_listed_with_their_settings(capsys) -> None:
    assert main(["strategies", "presets"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    files = sorted((ROOT / "experiments" / "configs").glob("*.json"))
    assert sorted(lines) == [f.stem for f in files]
    for f in files:
        policy = json.loads(f.read_text())
        for role in ("m2t", "t2t", "blocks", "remask"):
            params = ", ".join(f"{k}={json.dumps(v)}" for k, v in policy[role].get("params", {}).items())
            assert f"{role} {policy[role]['name']}" + (f"({params})" if params else "") in lines[f.stem]
    assert main(["strategies", "presets", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["llada2.1-q"] == json.loads(
        (ROOT / "experiments" / "configs" / "llada2.1-q.json").read_text())


def test_list_names_the_step_hooks_and_the_rules_that_ask_for_them(capsys) -> None:
    assert main(["strategies", "list"]) == 0
    out = capsys.readouterr().out
    hooks = out.split("step hooks (each asked for by a rule", 1)[1]
    for hook, rule in (("dlm_toolkit.hooks.verify:VerifyHook", "m2t s2d2"), ("dlm_toolkit.hooks.indel:IndelHook", "t2t indel"),
                       ("dlm_toolkit.hooks.dynamic_blocks:DynamicBlocksHook", "blocks dsb"),
                       ("dlm_toolkit.hooks.shadow:ShadowHook", "remask wino_shadow")):
        assert f"{hook}  <- {rule} [built-in]" in hooks
    assert "<- m2t threshold " not in hooks  # near miss: a rule that asks for none is not listed
    assert main(["strategies", "list", "--json"]) == 0
    listed = {(h["role"], h["rule"]) for h in json.loads(capsys.readouterr().out)["hooks"]}
    assert {("m2t", "s2d2"), ("t2t", "indel"), ("blocks", "dsb"), ("remask", "wino_shadow")} <= listed


def test_a_parent_run_made_without_a_description_gets_one_on_resume(swept) -> None:
    """Runs in this file's order, last: it adds a trial to the module's study."""
    from mlflow import MlflowClient

    client, parent = MlflowClient(swept["uri"]), swept["first"].parent_run_id
    client.delete_tag(parent, "mlflow.note.content")  # as a parent made by an older toolkit
    again = run_sweep(swept["exp"], 6, storage=swept["storage"], tracking_uri=swept["uri"], progress=False,
                      heartbeat_interval=2, threads=1)
    assert again.parent_run_id == parent and again.counts.counted == 6
    assert "`n_complete` = COMPLETE trials" in client.get_run(parent).data.tags["mlflow.note.content"]


def test_a_trial_with_nan_metrics_takes_no_part_in_the_front():
    """A damaged store's NaN accuracy compares false both ways: without the filter it sits on the
    front and pushes the slower true-front trial off it."""
    import math

    from dlm_toolkit.sweep.pareto import TrialPoint, summarize_points

    pts = [TrialPoint(0, {"accuracy": 0.9, "tpf": 1.0}, {}, None, "a", None),
           TrialPoint(1, {"accuracy": 0.5, "tpf": 2.0}, {}, None, "b", None),
           TrialPoint(2, {"accuracy": float("nan"), "tpf": 3.0}, {}, None, "c", None)]
    s = summarize_points("s", {"accuracy": "maximize", "tpf": "maximize"}, pts)
    assert [p.trial for p in s.front] == [0, 1] and len(s.points) == 3  # kept, for the pages to name
    assert math.isfinite(s.hypervolume) and math.isfinite(s.auc)
