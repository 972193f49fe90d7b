"""Sweeps across processes: `dlm sweep` killed with SIGKILL mid-trial then resumed; two workers on one study."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from dlm_toolkit.config import ConfigError
from dlm_toolkit.sweep.experiment import load_experiment
from dlm_toolkit.sweep.storage import load_study
from dlm_toolkit.sweep.study import run_sweep
from dlm_toolkit.sweep.trials import is_counted

import sweep_helpers as h


def _trials(storage: str) -> list:
    # Only open the storage with Optuna once the sweep has created it: opening a fresh SQLite file
    # from here would race the sweep's own schema creation.
    path = storage.removeprefix("sqlite:///")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            if not db.execute("select 1 from studies where study_name = 't'").fetchone():
                return []
    except sqlite3.Error:  # no file or no schema yet
        return []
    try:
        return load_study(storage, "t").get_trials(deepcopy=False)
    except Exception:
        return []


def test_kill_9_mid_trial_then_same_command_resumes_to_n(tmp_path):
    f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=16, n_trials=4))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    cmd = ["sweep", str(f), "--storage", storage, "--tracking-uri", uri, "--heartbeat", "1", "--threads", "1",
           "--no-progress"]
    proc = subprocess.Popen([*h.DLM, *cmd], cwd=tmp_path, env=h.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    deadline = time.time() + 180
    try:
        while True:  # wait until >= 1 trial finished and another one is running
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.time() < deadline, "no trial finished in time"
            trials = _trials(storage)
            if any(t.state == TrialState.COMPLETE for t in trials) and any(
                    t.state == TrialState.RUNNING and t.user_attrs.get("mlflow_run_id") for t in trials):
                break  # ... and has its MLflow run open
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = {t.number: t.values for t in _trials(storage) if t.state == TrialState.COMPLETE}
    killed = [t.number for t in _trials(storage) if t.state == TrialState.RUNNING]
    assert before and killed
    assert any(r.info.status == "RUNNING" for r in h.runs(uri) if r.data.tags.get("kind") == "trial")

    again = h.dlm(*cmd, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Pareto front of study 't'" in again.stdout and "mlflow ui --backend-store-uri" in again.stdout

    trials = _trials(storage)
    assert sum(is_counted(t) for t in trials) == 4  # exactly N finished trials
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 4 and len({t.number for t in complete}) == 4
    for number, values in before.items():  # finished trials were kept, not redone
        assert trials[number].state == TrialState.COMPLETE and trials[number].values == values
    for number in killed:  # the killed trial was failed by its heartbeat and retried with the same params
        assert trials[number].state == TrialState.FAIL and not trials[number].user_attrs.get("error")
        retry = [t for t in trials if number in t.system_attrs.get("retry_history", [])]
        assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE
        assert trials[number].params.items() <= retry[0].params.items()  # (empty if killed before sampling)
        assert retry[0].user_attrs.get("preset") == trials[number].user_attrs.get("preset")
    assert [t.user_attrs.get("preset") for t in complete].count("llada2.1-q") == 1

    runs = h.runs(uri)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert len([r for r in runs if r.data.tags.get("kind") == "study"]) == 1
    trial_runs = [r for r in runs if r.data.tags.get("kind") == "trial"]
    finished = sorted(int(r.data.tags["trial_number"]) for r in trial_runs if r.info.status == "FINISHED")
    assert finished == sorted(t.number for t in complete)  # one run per finished trial, none duplicated
    for number in killed:
        (run,) = [r for r in trial_runs if r.data.tags["trial_number"] == str(number)]
        assert run.info.status == "KILLED" and "retried as trial" in run.data.tags["killed_reason"]


def test_two_workers_share_one_study(tmp_path):
    # worker 0 (this process) starts at once, worker 1 after its imports and model load (~5-10 s):
    # enough short trials (~0.3 s) that both take part
    exp = load_experiment(h.experiment(n=64, batch_size=64))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    result = run_sweep(exp, 48, storage=storage, tracking_uri=uri, workers=2, progress=False, threads=1,
                       heartbeat_interval=2)
    trials = load_study(storage, "t").get_trials()
    assert result.counts.counted == 48 and sum(is_counted(t) for t in trials) == 48
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    workers = {t.user_attrs["worker"] for t in complete}
    assert len(workers) == 2, f"only {workers} ran trials"
    assert [t.user_attrs.get("preset") for t in trials].count("llada2.1-s") == 1
    runs = h.runs(uri)
    assert not [r for r in runs if r.info.status == "RUNNING"]
    assert sorted(int(r.data.tags["trial_number"]) for r in runs if r.data.tags.get("kind") == "trial"
                  and r.info.status == "FINISHED") == sorted(t.number for t in complete)
    parent = [r for r in runs if r.data.tags.get("kind") == "study"]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"


def test_workers_never_import_from_the_working_folder(tmp_path, monkeypatch):
    planted = tmp_path / "cwd"
    planted.mkdir()
    marker = tmp_path / "planted-module-ran"
    for name in ("mlflow", "optuna", "torch"):  # what a worker imports first
        (planted / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('{name} ')\nraise SystemExit(3)\n")
    monkeypatch.chdir(planted)
    exp = load_experiment(h.experiment(n=16, batch_size=16))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    result = run_sweep(exp, 24, storage=storage, tracking_uri=uri, workers=2, progress=False, threads=1)
    assert not marker.exists(), f"a worker imported a planted module: {marker.read_text()}"
    complete = [t for t in load_study(storage, "t").get_trials() if t.state == TrialState.COMPLETE]
    assert result.counts.counted == 24 and complete


def _worker_children() -> list[int]:
    return h.children(os.getpid(), b"dlm_toolkit.sweep.worker")


def test_bad_input_with_workers_leaves_no_worker_behind(tmp_path):
    # workers 1..K-1 start before the checks (to hide their imports); a failed check must send them home
    exp = load_experiment(h.experiment(model=tmp_path / "missing"))
    with pytest.raises(ConfigError, match="checkpoint folder"):
        run_sweep(exp, 4, storage=f"sqlite:///{tmp_path}/optuna.db", tracking_uri=h.tracking_uri(tmp_path),
                  workers=3, progress=False)
    assert _worker_children() == []
    assert not (tmp_path / "optuna.db").exists()


def test_restarts_continue_the_search_instead_of_replaying_it(tmp_path):
    """Five restarts of the same command (each adds 4 trials): a sampler seeded only by the
    experiment seed would propose the same 4 policies every time."""
    exp = load_experiment(h.experiment(n=4, presets_to_enqueue=[],
                                       search_space={"m2t.params.threshold": {"float": [0.3, 0.99]},
                                                     "t2t.params.threshold": {"float": [0.0, 0.95]}}))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    for total in (4, 8, 12, 16, 20):
        run_sweep(exp, total, storage=storage, tracking_uri=uri, progress=False, threads=1)
    hashes = [t.user_attrs["policy_hash"] for t in load_study(storage, "t").get_trials() if t.state == TrialState.COMPLETE]
    assert len(hashes) == 20 and len(set(hashes)) >= 18, f"{len(set(hashes))} distinct policies of 20"


def _together(commands: list[list[str]], cwd: Path) -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    out = []
    for p, c in zip(procs, commands):
        stdout, stderr = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess(c, p.returncode, stdout, stderr))
    return out


def test_concurrent_first_use_of_one_new_store_all_succeed(tmp_path):
    """Two evals on one new MLflow SQLite file and two sweeps on one new Optuna SQLite file, each
    pair started at once: every command succeeds and every result is stored."""
    ckpt = str(h.REPO / "checkpoints" / "testbed-editable")
    uri = f"sqlite:///{tmp_path}/new-mlflow.db"
    evals = [[*h.DLM, "eval", "--checkpoint", ckpt, "--task", "add", "--n", "2", "--json", "--no-progress",
              "--tracking-uri", uri, "--seed", str(s)] for s in (0, 1)]
    h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=4))
    sweeps = [[*h.DLM, "sweep", str(tmp_path / "exp.yaml"), "--n-trials", "3", "--storage",
               f"sqlite:///{tmp_path}/new-optuna.db", "--tracking-uri", f"sqlite:///{tmp_path}/sweep-mlflow-{k}.db",
               "--no-progress"] for k in (0, 1)]
    results = _together(evals + sweeps, tmp_path)
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
    run_ids = {json.loads(r.stdout)["mlflow_run_id"] for r in results[:2]}
    assert len(run_ids) == 2 and None not in run_ids
    assert sum(is_counted(t) for t in load_study(f"sqlite:///{tmp_path}/new-optuna.db", "t").get_trials()) == 3


def test_devices_place_one_worker_per_device(tmp_path):
    from dlm_toolkit.sweep.study import place_workers

    assert place_workers(1, None, ["cpu", "cpu", "cpu"]) == ["cpu"] * 3
    assert place_workers(3, None, ["cpu", "cpu", "cpu"]) == ["cpu"] * 3
    assert place_workers(2, "cpu") == ["cpu", "cpu"] and place_workers(1, None) == ["cpu"]
    with pytest.raises(ConfigError, match="workers: 3 workers but 2 devices"):
        place_workers(3, None, ["cpu", "cpu"])
    with pytest.raises(ConfigError, match="device: 'cuda:0'"):
        place_workers(1, None, ["cpu", "cuda:0"])
    with pytest.raises(ConfigError, match="device: 'tpu'"):
        place_workers(2, "tpu")

    f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=8, n_trials=4))
    storage, uri = f"sqlite:///{tmp_path}/optuna.db", h.tracking_uri(tmp_path)
    base = ["sweep", str(f), "--storage", storage, "--tracking-uri", uri, "--threads", "1", "--no-progress"]
    bad = h.dlm(*base, "--devices", "cpu,cuda:0", cwd=tmp_path)
    assert bad.returncode == 2 and "device: 'cuda:0'" in bad.stderr
    assert not (tmp_path / "optuna.db").exists() and _worker_children() == []  # nothing written, nobody left
    ok = h.dlm(*base, "--devices", "cpu,cpu", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    trials = load_study(storage, "t").get_trials()
    assert sum(is_counted(t) for t in trials) == 4
    assert {r.data.tags.get("provenance.device") for r in h.runs(uri) if r.data.tags.get("kind") == "trial"} == {"cpu"}
