"""README "Reproduce the paper", at small size: the same commands and experiment files, on the
testbed model (given a chat template) and the benchmark fixtures instead of a released checkpoint
and the real data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from optuna.trial import TrialState

from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.sweep.experiment import load_experiment
from dlm_toolkit.sweep.pareto import decode_outcomes
from dlm_toolkit.sweep.storage import load_study

import sweep_helpers as h
from sweep_helpers import restore_torch_threads  # noqa: F401

pytestmark = pytest.mark.usefixtures("restore_torch_threads")

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "benchmarks"


@pytest.fixture(scope="module")
def chat_testbed(tmp_path_factory):
    """The testbed with a chat template (plain text: the char tokenizer has no control tokens)."""
    folder = tmp_path_factory.mktemp("repro") / "LLaDA2.1-mini"
    shutil.copytree(REPO / "checkpoints" / "testbed-editable", folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_eval_command(chat_testbed, capsys):
    """README: dlm eval --checkpoint models/LLaDA2.1-mini --task gsm8k --data data/gsm8k --chat true ..."""
    assert main(["eval", "--checkpoint", str(chat_testbed), "--task", "gsm8k", "--data", str(FIXTURES / "gsm8k"),
                 "--chat", "true", "--n", "6", "--gen-length", "16", "--batch-size", "8", "--json", "--no-progress",
                 "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "gsm8k" and out["chat"] is True and len(out["instances"]) == 6
    assert out["policy"]["blocks"]["params"]["block_length"] == 32 and out["metric_name"] == "exact_match"


def test_the_paper_experiment_sweeps(chat_testbed, tmp_path, capsys):
    """experiments/llada2.1-gsm8k.yaml with the model, data and sizes made small: the S and Q presets
    run first, every trial keeps its per-instance outcomes, and the front prints."""
    data = yaml.safe_load((REPO / "experiments" / "llada2.1-gsm8k.yaml").read_text())
    assert data["task"] == "gsm8k" and data["task_args"]["chat"] is True
    data.update(model=str(chat_testbed), n=4, batch_size=4, n_trials=2)
    data["task_args"] = {**data["task_args"], "data": str(FIXTURES / "gsm8k"), "answer_length": 12}
    path = h.write_yaml(tmp_path / "llada2.1-gsm8k.yaml", data)
    storage = f"sqlite:///{tmp_path}/optuna.db"
    assert main(["sweep", str(path), "--storage", storage, "--tracking-uri", h.tracking_uri(tmp_path),
                 "--threads", "1", "--no-progress", "--json"]) == 0
    trials = load_study(storage, "llada2.1-gsm8k").get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert [t.user_attrs.get("preset") for t in trials] == ["llada2.1-s", "llada2.1-q"]
    assert all(len(decode_outcomes(t.user_attrs["outcomes"])) == 4 for t in trials)


def test_experiment_data_paths_resolve_and_missing_data_stops_before_any_trial(tmp_path):
    data = yaml.safe_load((REPO / "experiments" / "llada2.1-gsm8k.yaml").read_text())
    shutil.copytree(FIXTURES / "gsm8k", tmp_path / "bench" / "gsm8k")
    data.update(model=str(REPO / "checkpoints" / "testbed-editable"))
    data["task_args"] = {**data["task_args"], "data": "bench/gsm8k", "chat": "auto"}
    exp = load_experiment(h.write_yaml(tmp_path / "exp.yaml", data))
    assert exp.task_args["data"] == str(tmp_path / "bench" / "gsm8k")
    data["task_args"]["data"] = "nowhere"
    with pytest.raises(ConfigError, match=r"task .gsm8k.: no data file at \S*nowhere \(data\).*curl"):
        load_experiment(h.write_yaml(tmp_path / "exp.yaml", data))
