"""What a sweep against an MLflow tracking server prints, checked against the real server: the link it
ends with opens (the page and, through the REST API, the run it names), MLflow's own two emoji links per
run stay quiet unless ``--verbose``, every trial gets one line of ours, and the runs table opens with
the metric columns chosen (MLflow's shared view state)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

import servers
import sweep_helpers as h
from dlm_toolkit.sweep.uris import hide_web_password


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow-server")
    with servers.mlflow_server(f"sqlite:///{folder / 'mlflow.db'}", folder) as url:
        yield url


def get(url: str) -> tuple[int, bytes]:
    """HTTP GET as a browser sends it: the fragment (``#/...``) stays in the browser."""
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


@pytest.fixture(scope="module")
def sweep(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    f = h.write_yaml(folder / "exp.yaml", h.experiment(n=8, n_trials=3, presets_to_enqueue=["llada2.1-q"]))
    out = h.dlm("sweep", str(f), "--storage", f"sqlite:///{folder}/optuna.db", "--tracking-uri", server,
                "--threads", "1", "--no-progress", cwd=folder)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_the_printed_link_opens_the_parent_run(server, sweep):
    [link] = re.findall(r"MLflow:  open (\S+)", sweep.stdout)
    assert link.startswith(f"{server}/#/experiments/") and "%23" not in link
    status, body = get(link)
    assert status == 200 and b"<html" in body.lower()  # the UI's page (an encoded '#' gave 404)
    experiment_id, run_id = re.fullmatch(r".*/#/experiments/(\w+)/runs/(\w+)\?workflowType=machine_learning",
                                         link).groups()
    status, body = get(f"{server}/api/2.0/mlflow/runs/get?run_id={run_id}")
    run = json.loads(body)["run"]
    assert status == 200 and run["info"]["experiment_id"] == experiment_id
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["kind"] == "study" and tags["study_name"] == "t"


def test_one_line_per_trial_and_no_mlflow_chatter(sweep):
    assert "View run" not in sweep.stdout + sweep.stderr and "🏃" not in sweep.stdout
    lines = re.findall(r"^trial (\d+) COMPLETE  accuracy ([\d.]+)  tpf ([\d.]+)  nfe_mean ([\d.]+)(.*)$",
                       sweep.stderr, flags=re.M)
    assert sorted(int(n) for n, *_ in lines) == [0, 1, 2]
    assert "preset llada2.1-q" in dict((int(n), rest) for n, *_, rest in lines)[0]


def test_verbose_brings_mlflow_links_back(server, tmp_path):
    f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=4, n_trials=1))
    out = h.dlm("sweep", str(f), "--storage", f"sqlite:///{tmp_path}/optuna.db", "--tracking-uri", server,
                "--threads", "1", "--no-progress", "--study-name", "verbose", "--verbose", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "View run trial-0 at:" in out.stdout


def test_runs_table_link_selects_the_metric_columns(server, sweep):
    [link] = re.findall(r"runs table with accuracy, tpf and nfe_mean columns: (\S+)", sweep.stdout)
    experiment_id, key = re.fullmatch(
        rf"{re.escape(server)}/#/experiments/(\w+)/runs\?workflowType=machine_learning&viewStateShareKey=(\w+)",
        link).groups()
    status, body = get(f"{server}/api/2.0/mlflow/experiments/get?experiment_id={experiment_id}")
    tags = {t["key"]: t["value"] for t in json.loads(body)["experiment"]["tags"]}
    view = json.loads(tags[f"mlflow.sharedViewState.{key}"])
    # MLflow's canonical column keys: type.`name`
    assert {"metrics.`accuracy`", "metrics.`tpf`", "metrics.`nfe_mean`"} <= set(view["selectedColumns"])
    assert view["orderByKey"] == "metrics.`accuracy`" and view["orderByAsc"] is False


@pytest.mark.parametrize("url, shown", [
    ("http://user:secret@host:5000/#/experiments/1/runs/ab?workflowType=machine_learning",
     "http://user:***@host:5000/#/experiments/1/runs/ab?workflowType=machine_learning"),
    ("https://host/#/experiments/1", "https://host/#/experiments/1"),
])
def test_web_addresses_keep_their_fragment_and_lose_their_password(url, shown):
    assert hide_web_password(url) == shown


def test_eval_json_stays_one_object_against_a_server(server, tmp_path):
    out = h.dlm("eval", "--checkpoint", str(h.checkpoint()), "--task", "add", "--n", "4", "--json", "--no-progress",
                "--tracking-uri", server, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout)  # MLflow's links would have gone to stdout before it
    assert record["mlflow_run_id"]
