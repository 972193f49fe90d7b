"""Provenance of every result: plug-in hashes (checked against the files), versions, commit,
device and dtype in dlm eval --json, MLflow runs and Optuna trials; dlm replay warns on a change."""

from __future__ import annotations

import hashlib
import inspect
import json
import subprocess
from pathlib import Path

import torch
import transformers

import sweep_helpers as h
from dlm_toolkit.cli import main
from dlm_toolkit.strategy.registry import BLOCKS, M2T, REMASK, T2T
from dlm_toolkit.sweep import load_experiment, run_sweep
from dlm_toolkit.sweep.storage import load_study

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = str(REPO / "checkpoints" / "testbed-editable")


def sha(cls) -> str:
    return hashlib.sha256(Path(inspect.getsourcefile(cls)).read_bytes()).hexdigest()


def test_eval_json_carries_provenance(capsys):
    assert main(["eval", "--checkpoint", CHECKPOINT, "--task", "sort", "--n", "2", "--json", "--no-progress",
                 "--set", "remask.name=low_confidence"]) == 0
    prov = json.loads(capsys.readouterr().out)["provenance"]
    assert prov["torch"] == torch.__version__ and prov["transformers"] == transformers.__version__
    assert prov["device"] == "cpu" and prov["dtype"] == "float32"
    want = {("m2t", M2T.get("threshold")), ("t2t", T2T.get("threshold")), ("blocks", BLOCKS.get("semi_ar")),
            ("remask", REMASK.get("low_confidence"))}
    assert {(p["role"], p["class"]) for p in prov["plugins"]} == {(r, f"{c.__module__}:{c.__qualname__}") for r, c in want}
    for p in prov["plugins"]:
        cls = {"m2t": M2T, "t2t": T2T, "blocks": BLOCKS, "remask": REMASK}[p["role"]].get(p["name"])
        assert p["sha256"] == sha(cls) and p["distribution"] == "dlm-toolkit"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # in a checkout
        assert prov["git_commit"].removesuffix("-dirty") == head.stdout.strip()


def test_trials_record_provenance_and_replay_warns_on_a_changed_plugin(tmp_path, capsys):
    from mlflow import MlflowClient

    exp = load_experiment(h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=4)))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    run_sweep(exp, 2, storage=storage, tracking_uri=uri, progress=False, threads=1)
    study = load_study(storage, "t")
    trial = next(t for t in study.trials if t.state.name == "COMPLETE")
    hashes = trial.user_attrs["plugin_hashes"]
    assert hashes[f"{M2T.get('threshold').__module__}:{M2T.get('threshold').__qualname__}"] == sha(M2T.get("threshold"))
    client = MlflowClient(uri)
    run = client.get_run(trial.user_attrs["mlflow_run_id"])
    assert run.data.tags["provenance.device"] == "cpu" and run.data.tags["provenance.torch"] == torch.__version__
    assert "strategies.m2t_threshold:ThresholdUnmask@" in run.data.tags["provenance.plugins"]
    assert "provenance.json" in {a.path for a in client.list_artifacts(run.info.run_id)}

    args = ["replay", "--storage", storage, "--study-name", "t", "--trial", str(trial.number), "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []
    tampered = {k: "0" * 64 for k in hashes}  # as if the plug-ins changed since the trial ran
    import sqlite3

    with sqlite3.connect(tmp_path / "optuna.db") as db:  # Optuna refuses to edit a finished trial
        db.execute("UPDATE trial_user_attributes SET value_json = ? WHERE trial_id = ? AND key = 'plugin_hashes'",
                   (json.dumps(tampered), trial._trial_id))
    assert main(args) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["warnings"]) == len(hashes)
    assert "warning: plug-in strategies." in captured.err and "changed since the trial ran" in captured.err
