"""Sweeps beyond one machine, against real servers set up by README's "Scale out" block as written:
Optuna on PostgreSQL, MLflow behind `mlflow server` (its backend in the same PostgreSQL, artifacts
served by the server), every client reaching them by this machine's host name rather than 127.0.0.1;
workers on two "hosts" (separate working folders and process groups), one of them SIGKILLed mid-sweep
and restarted."""

from __future__ import annotations

import os
import pwd
import random
import secrets
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from optuna.trial import TrialState

from dlm_toolkit.sweep.storage import load_study
from dlm_toolkit.sweep.trials import is_counted

import readme_shell
import servers
import sweep_helpers as h


@pytest.fixture(scope="module", autouse=True)
def postgresql_installed():
    """A missing server fails every test here with how to install it; it never skips them."""
    if servers.postgres_bin() is None:
        pytest.fail("PostgreSQL is not installed (no initdb): apt-get install postgresql "
                    "(bash scripts/test.sh installs it)", pytrace=False)


def readme_steps() -> dict[str, str]:
    """README's scale-out block cut at its comment lines: ``settings`` (before ``pip install``),
    ``install``, and ``1`` .. ``5``, each the lines as written."""
    [block] = readme_shell.bash_blocks(readme_shell.section("Scale out"))
    lines = block.splitlines()
    install = next(i for i, line in enumerate(lines) if line.startswith("pip install"))
    steps = {"settings": "\n".join(lines[:install]), "install": lines[install]}
    starts = [i for i, line in enumerate(lines) if line[:4] in {f"# {k}." for k in range(1, 10)}]
    for a, b in zip(starts, [*starts[1:], len(lines)]):
        steps[lines[a][2]] = "\n".join(lines[a:b])
    return steps


def settings_line(values: dict[str, str]) -> str:
    """README's settings line with other values: the same variables, in the same order."""
    names = [w.split("=", 1)[0] for w in shlex.split(readme_steps()["settings"], comments=True)
             if "=" in w]
    assert sorted(names) == sorted(values), (names, sorted(values))
    return "export " + " ".join(f"{k}={shlex.quote(values[k])}" for k in names)


class ReadmeServers:
    """README steps 1 and 2 with this machine's host name, free ports and folders of its own."""

    def __init__(self) -> None:
        host = socket.gethostname()
        socket.getaddrinfo(host, None)  # README's recipe needs host names every host resolves
        self.folder = Path(tempfile.mkdtemp(prefix="dlm-readme-servers-"))  # pytest's are private to root
        self.user = "postgres" if os.geteuid() == 0 else None  # what README tells root to do
        if self.user:
            entry = pwd.getpwnam(self.user)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)
        self.values = {"DB_HOST": host, "DB_PORT": str(servers.free_port()), "MLFLOW_HOST": host,
                       "MLFLOW_PORT": str(servers.free_port()), "DASHBOARD_PORT": str(servers.free_port()),
                       "PGUSER": "dlm", "PGPASSWORD": secrets.token_hex(8), "PGDATA": str(self.folder / "pg"),
                       "ARTIFACTS": str(self.folder / "artifacts"), "EXPERIMENT": str(self.folder / "exp.yaml")}
        self.settings = settings_line(self.values)
        self.steps = readme_steps()
        self.mlflow: subprocess.Popen | None = None
        self.storage = f"postgresql://dlm@{host}:{self.values['DB_PORT']}/optuna"
        self.tracking = f"http://{host}:{self.values['MLFLOW_PORT']}"
        self.env = readme_shell.fresh_env()

    def shell(self, step: str, **kwargs) -> subprocess.CompletedProcess:
        done = readme_shell.run(f"{self.settings}\n{self.steps[step]}", **kwargs)
        assert done.returncode == 0, f"README step {step}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done

    def start(self) -> None:
        self.shell("1", user=self.user, activate=False, timeout=120)  # PostgreSQL needs no venv
        self.mlflow = readme_shell.start(f"{self.settings}\n{self.steps['2']}\nwait")
        deadline = time.time() + 120
        while True:
            assert self.mlflow.poll() is None, self.mlflow.communicate()[1][-3000:]
            try:
                if urllib.request.urlopen(f"{self.tracking}/health", timeout=2).status == 200:
                    break
            except OSError:
                assert time.time() < deadline, "mlflow server did not come up"
                time.sleep(0.25)

    def close(self) -> None:
        if self.mlflow is not None:
            readme_shell.stop(self.mlflow)
        pg_path = next(line for line in self.steps["1"].splitlines() if line.startswith("export PATH="))
        pg_stop = self.steps["5"].splitlines()[-1]  # the step's PostgreSQL line, as its user
        readme_shell.run(f"{self.settings}\n{pg_path}\n{pg_stop}", user=self.user, activate=False, timeout=120)
        subprocess.run(["rm", "-rf", str(self.folder)], check=False)


@pytest.fixture(scope="module")
def readme_servers():
    started = ReadmeServers()
    saved = os.environ.get("PGPASSWORD")
    os.environ["PGPASSWORD"] = started.values["PGPASSWORD"]  # this process reads the study too
    try:
        started.start()
        yield started
    finally:
        started.close()
        if saved is None:
            os.environ.pop("PGPASSWORD", None)
        else:
            os.environ["PGPASSWORD"] = saved


@pytest.fixture(scope="module")
def stores(readme_servers):
    return readme_servers.storage, readme_servers.tracking


def test_readme_sweep_and_dashboard_lines_run_as_written(readme_servers):
    """Steps 3 and 4 verbatim (the experiment named in the settings line is a small one)."""
    h.write_yaml(Path(readme_servers.values["EXPERIMENT"]), h.experiment(name="readme", n=8, n_trials=3, threads=1))
    done = readme_servers.shell("3", timeout=300)
    assert f"MLflow:  open {readme_servers.tracking}/#/experiments/" in done.stdout, done.stdout[-2000:]
    assert sum(is_counted(t) for t in load_study(readme_servers.storage, "readme").get_trials()) == 3
    dashboard = readme_shell.start(f"{readme_servers.settings}\n{readme_servers.steps['4']}\nwait")
    try:
        url = f"http://{readme_servers.values['DB_HOST']}:{readme_servers.values['DASHBOARD_PORT']}/api/studies"
        deadline = time.time() + 60
        while True:
            assert dashboard.poll() is None, dashboard.communicate()[1][-3000:]
            try:
                body = urllib.request.urlopen(url, timeout=2).read().decode()
                break
            except OSError:
                assert time.time() < deadline, "optuna-dashboard did not come up"
                time.sleep(0.25)
        assert '"study_name": "readme"' in body or '"study_name":"readme"' in body, body[:2000]
    finally:
        readme_shell.stop(dashboard)


def test_the_test_environment_has_what_readme_installs_for_scale_out():
    """The test runs README's lines without its `pip install` line (it would rebuild this very
    environment): everything that line installs is already here."""
    import importlib.metadata as md
    import tomllib

    install = readme_steps()["install"]
    assert shlex.split(install, comments=True)[:4] == ["pip", "install", "-q", "-e"] and '".[scale]"' in install
    extras = tomllib.loads((h.REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for requirement in extras["scale"]:
        name, version = requirement.split("==")
        assert md.version(name.split("[")[0]) == version, requirement


def _host(folder: Path, storage: str, tracking: str, *extra: str) -> tuple[list[str], Path]:
    """The same sweep command, run from its own working folder (another host's checkout)."""
    folder.mkdir(parents=True, exist_ok=True)
    f = h.write_yaml(folder / "exp.yaml", h.experiment(n=32, batch_size=8, n_trials=12))
    return [*h.DLM, "sweep", str(f), "--storage", storage, "--tracking-uri", tracking, "--threads", "1",
            "--heartbeat", "1", "--no-progress", *extra], folder


def _start(cmd: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env={**h.env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_workers_on_two_hosts_one_killed_share_one_study_exactly(stores, tmp_path):
    storage, tracking = stores
    cmd_a, cwd_a = _host(tmp_path / "host-a", storage, tracking, "--workers", "2")
    cmd_b, cwd_b = _host(tmp_path / "host-b", storage, tracking)
    host_a = _start(cmd_a, cwd_a)
    host_b = _start(cmd_b, cwd_b)
    deadline = time.time() + 240
    try:
        while True:  # kill host b (its whole process group) once it runs a trial and others finished
            assert host_b.poll() is None, host_b.communicate()[1][-2000:]
            assert time.time() < deadline, "no trial of host b started in time"
            try:
                trials = load_study(storage, "t").get_trials(deepcopy=False)
            except Exception:  # the study is not created yet
                trials = []
            mine = [t for t in trials if t.state == TrialState.RUNNING
                    and t.user_attrs.get("worker", "").endswith(f":{host_b.pid}")]
            if mine and sum(t.state == TrialState.COMPLETE for t in trials) >= 2:
                break
            time.sleep(0.05)
    finally:
        os.killpg(host_b.pid, signal.SIGKILL)
        host_b.wait()
    # the trial was RUNNING a moment before the kill; it may still have finished in between
    killed = [t.number for t in load_study(storage, "t").get_trials(deepcopy=False)
              if t.number == mine[0].number and t.state != TrialState.COMPLETE]
    # ... and host a's second worker (a child process) at a random moment soon after
    delay = random.Random().uniform(0.0, 2.0)
    time.sleep(delay)
    workers_a = h.children(host_a.pid, b"dlm_toolkit.sweep.worker")
    for pid in workers_a:
        os.kill(pid, signal.SIGKILL)
    again = subprocess.run(cmd_b, cwd=cwd_b, env={**h.env(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    out_a, err_a = host_a.communicate(timeout=300)
    assert host_a.returncode == 0, (delay, workers_a, err_a[-2000:])  # its own worker 0 carried on
    assert f"{tracking}/#/experiments/" in again.stdout and "workflowType=machine_learning" in again.stdout

    trials = load_study(storage, "t").get_trials()
    assert sum(is_counted(t) for t in trials) == 12  # exactly N finished trials, whoever ran them
    for number in killed:  # failed by its heartbeat and retried with the same params, not lost
        assert trials[number].state == TrialState.FAIL and not trials[number].user_attrs.get("error")
        assert any(number in t.system_attrs.get("retry_history", []) for t in trials)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len({t.user_attrs["worker"].rsplit(":", 1)[1] for t in complete}) >= 2  # several processes took part
    measured = [t.user_attrs["policy_hash"] for t in complete if t.user_attrs.get("duplicate_of") is None]
    # two workers may draw one new policy at the same instant; otherwise each policy is measured once
    assert len(measured) - len(set(measured)) <= 1
    runs = h.runs(tracking)
    assert [r.info.status for r in runs if r.info.status == "RUNNING"] == []
    parents = [r for r in runs if r.data.tags.get("kind") == "study" and r.data.tags.get("study_name") == "t"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    by_id = {r.info.run_id: r for r in runs}
    for t in complete:  # every finished trial has its closed run, tagged as in the SQLite case
        run = by_id[t.user_attrs["mlflow_run_id"]]
        assert run.info.status == "FINISHED" and run.data.tags["trial_number"] == str(t.number)
        assert run.data.tags["trial_state"] == "COMPLETE"
    for number in killed:
        assert by_id[trials[number].user_attrs["mlflow_run_id"]].info.status == "KILLED"
    arts = {a.path for a in h.artifacts(tracking, parents[0].info.run_id)}
    assert {"pareto.csv", "pareto.json", "pareto.png"} <= arts  # served by the server, not a local path


def test_unreachable_servers_fail_before_any_trial(stores, tmp_path):
    storage, tracking = stores
    f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=8, n_trials=2))
    port = servers.free_port()  # nothing listens there
    for args, fragment in ((["--storage", f"postgresql://dlm@127.0.0.1:{port}/optuna", "--tracking-uri", tracking],
                            "storage"),
                           (["--storage", storage, "--tracking-uri", f"http://127.0.0.1:{port}"], "tracking URI")):
        r = h.dlm("sweep", str(f), "--study-name", "unreachable", "--no-progress", *args, cwd=tmp_path, timeout=120)
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "unreachable" not in [s.study_name for s in __import__("optuna").get_all_study_summaries(storage)]


def test_a_database_user_without_write_rights_gets_a_clear_error(stores, tmp_path):
    import psycopg

    storage, tracking = stores
    server = storage.rsplit("/", 1)[0]
    with psycopg.connect(f"{server}/postgres", autocommit=True) as conn:
        conn.execute("CREATE ROLE reader LOGIN PASSWORD 'reader-pw'")
        conn.execute("CREATE DATABASE readonly")  # owned by dlm; PostgreSQL 15 lets nobody else create tables
    f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=8, n_trials=2))
    readonly = server.replace("dlm@", "reader:reader-pw@") + "/readonly"
    r = h.dlm("sweep", str(f), "--storage", readonly, "--tracking-uri", tracking, "--no-progress", cwd=tmp_path,
              timeout=120)
    assert r.returncode == 2 and "storage" in r.stderr and "permission denied" in r.stderr.lower(), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_database_that_crashes_mid_sweep(tmp_path):
    """PostgreSQL is SIGKILLed while a sweep runs. Back within --reconnect: the sweep goes on and ends
    with exactly N trials. Gone for longer: the sweep exits 2 saying what is kept; the same command
    later finishes the study, the interrupted trial retried, none lost."""
    cluster = servers.PostgresCluster(databases=("optuna",))
    try:
        storage = f"{cluster.url}/optuna"
        f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=16, batch_size=8, n_trials=10))
        base = ["sweep", str(f), "--storage", storage, "--tracking-uri", h.tracking_uri(tmp_path), "--threads", "1",
                "--heartbeat", "1", "--no-progress"]

        def crash_once_trials_finished(reconnect: str, down_s: float) -> subprocess.CompletedProcess:
            before = sum(is_counted(t) for t in _trials(storage))
            proc = _start([*h.DLM, *base, "--reconnect", reconnect], tmp_path)
            deadline = time.time() + 180
            # kill at the first finished trial: with nine trials still to run, the sweep is far from its end
            while sum(is_counted(t) for t in _trials(storage)) < before + 1:
                assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
                time.sleep(0.1)
            cluster.kill()
            time.sleep(down_s)
            if down_s < float(reconnect):
                cluster.start()
            out, err = proc.communicate(timeout=300)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

        back = crash_once_trials_finished(reconnect="60", down_s=3)
        assert back.returncode == 0, back.stderr[-2000:]
        assert "stopped answering" in back.stderr
        assert sum(is_counted(t) for t in load_study(storage, "t").get_trials()) == 10

        f.write_text(f.read_text().replace("n_trials: 10", "n_trials: 20"))  # same study, a bigger target
        gone = crash_once_trials_finished(reconnect="4", down_s=8)
        assert gone.returncode == 2 and "connection lost" in gone.stderr and "Traceback" not in gone.stderr, \
            gone.stderr[-2000:]
        cluster.start()
        again = h.dlm(*base, "--reconnect", "60", cwd=tmp_path, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        trials = load_study(storage, "t").get_trials()
        assert sum(is_counted(t) for t in trials) == 20
        lost = [t for t in trials if t.state == TrialState.FAIL and not t.user_attrs.get("error")]
        for t in lost:  # the trial in flight at the crash was retried with its parameters
            assert any(t.number in r.system_attrs.get("retry_history", []) for r in trials)
    finally:
        cluster.close()


def _trials(storage: str) -> list:
    try:
        return load_study(storage, "t").get_trials(deepcopy=False)
    except Exception:
        return []


def test_a_tracking_server_that_dies_mid_sweep(tmp_path):
    """`mlflow server` is SIGKILLed while a sweep logs to it: after the MLflow client's retries the
    sweep exits 2 saying so, the trial in flight is failed (not counted) with a retry queued, no trial
    is half-written; with the server back, the same command finishes exactly N trials."""
    server = servers.MlflowServer(f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}", tmp_path / "mlflow")
    try:
        storage = f"sqlite:///{tmp_path}/optuna.db"
        f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=16, batch_size=8, n_trials=10))
        cmd = [*h.DLM, "sweep", str(f), "--storage", storage, "--tracking-uri", server.url, "--threads", "1",
               "--heartbeat", "1", "--no-progress"]
        env = {**h.env(), "OMP_NUM_THREADS": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        deadline = time.time() + 180
        while True:  # kill it once trials finished and one is in flight with its run open
            trials = _trials(storage)
            if sum(is_counted(t) for t in trials) >= 3 and any(
                    t.state == TrialState.RUNNING and t.user_attrs.get("mlflow_run_id") for t in trials):
                break
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.01)
        server.kill()
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2 and "MLflow server stopped answering" in err and "Traceback" not in err, err[-3000:]
        trials = load_study(storage, "t").get_trials()
        assert not [t.number for t in trials if t.state == TrialState.FAIL and t.user_attrs.get("error")]
        assert [t.state for t in trials].count(TrialState.FAIL) <= 1
        for t in trials:
            if t.state == TrialState.COMPLETE:  # finished means fully stored
                assert t.user_attrs.get("metrics") and t.user_attrs.get("outcomes")
            elif t.state == TrialState.FAIL:  # the trial in flight: marked failed, retried with its params
                assert t.user_attrs.get("interrupted")
                retry = [r for r in trials if t.number in r.system_attrs.get("retry_history", [])]
                assert len(retry) == 1 and retry[0].state == TrialState.WAITING and retry[0].params == t.params
            else:
                assert t.state == TrialState.WAITING, t
        server.start()
        again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-2000:]
        trials = load_study(storage, "t").get_trials()
        assert sum(is_counted(t) for t in trials) == 10
        runs = h.runs(server.url)
        assert [r for r in runs if r.info.status == "RUNNING"] == []  # the orphaned run was closed on resume
        assert len([r for r in runs if r.data.tags.get("kind") == "study"]) == 1
    finally:
        server.close()
