"""Races and lost work (issue 35, items 5, 6 and 9): `dlm train` checks everything before step 1 and
owns its --out; two sweeps creating one study; a storage that keeps failing; refused commands that
write nothing; the atomic writer's file mode. Real processes wherever the race is between processes."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm_toolkit.util.files import atomic_write, write_text

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO),
       "OMP_NUM_THREADS": "1"}
DLM = [sys.executable, "-c", "import sys\nfrom dlm_toolkit.cli import main\nsys.exit(main())"]
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, n_group=2,
            topk_group=1, max_position_embeddings=64, tasks={"add": 1.0}, steps=2, batch_tokens=128,
            warmup_steps=1, eval_n=0, checkpoint_interval=0, block_lengths=[4], threads=1)


def config_file(folder: Path, name: str = "train.json", **changes) -> Path:
    path = folder / name
    path.write_text(json.dumps({**TINY, **changes}))
    return path


def dlm(*args: str, prefix: tuple[str, ...] = (), timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, *DLM, *args], capture_output=True, text=True, env=ENV, timeout=timeout, **kw)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[0]


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ------------------------------------------------------------------------------- train: before step 1
def test_train_checks_the_eval_policy_and_the_out_path_before_step_1(tmp_path, capsys):
    """Each mistake is one line before any step (nothing created); the same command with the
    mistake mended trains (evals included), so the check is not simply strict."""
    from dlm_toolkit.cli import main

    def refused(*args: str) -> str:
        assert main(["train", *args, "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]

    before = tree(tmp_path)
    typo = refused(str(config_file(tmp_path, eval_preset="llada2.1-qq", eval_n=2)), "--out", str(tmp_path / "a"))
    assert "eval_preset: unknown preset or policy file 'llada2.1-qq'" in typo
    # a policy file the schema refuses
    policy = json.loads((REPO / "experiments/configs/llada2.1-q.json").read_text())
    policy["blocks"]["params"]["block_length"] = -4
    (tmp_path / "bad.json").write_text(json.dumps(policy))
    bad = refused(str(config_file(tmp_path, eval_preset=str(tmp_path / "bad.json"), eval_n=2)), "--out",
                  str(tmp_path / "a"))
    assert bad.startswith("error: eval_preset: blocks.params.block_length: ")
    # the eval's canvases (blocks of 32 for llada2.1-q) past the model's context: found now, not after training
    wide = refused(str(config_file(tmp_path, max_position_embeddings=24, eval_n=2)), "--out", str(tmp_path / "a"))
    assert "eval_preset: 'llada2.1-q' decodes task 'add' in blocks of 32" in wide
    (tmp_path / "plain").write_text("x")
    below = refused(str(config_file(tmp_path)), "--out", str(tmp_path / "plain" / "sub" / "out"))
    assert below == f"error: out: {tmp_path}/plain/sub/out cannot be created: {tmp_path}/plain is not a folder"
    assert tree(tmp_path) == sorted([*before, "train.json", "bad.json", "plain"])
    assert (tmp_path / "plain").read_text() == "x"
    # near misses: a valid policy file with evals, and missing parents (created), both train
    policy["blocks"]["params"]["block_length"] = 8
    (tmp_path / "good.json").write_text(json.dumps(policy))
    assert main(["train", str(config_file(tmp_path, eval_preset=str(tmp_path / "good.json"), eval_n=2,
                                          max_position_embeddings=24)),
                 "--out", str(tmp_path / "new" / "deeper" / "out"), "--no-progress"]) == 0
    info = json.loads((tmp_path / "new/deeper/out/training.json").read_text())
    assert info["evals"] and not (tmp_path / "new/deeper/out/.dlm-train.lock").exists()


def test_train_refuses_an_out_without_room_for_the_checkpoint(tmp_path):
    """A 2 MB tmpfs cannot hold the run's largest write (plus 4 MB slack): refused before step 1;
    a 64 MB one can."""
    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap missing: install it with `apt-get install bubblewrap` (scripts/test.sh does)"
    cfg = config_file(tmp_path)
    small = dlm("train", str(cfg), "--out", "/small/out", "--no-progress",
                prefix=(bwrap, "--dev-bind", "/", "/", "--size", str(2 << 20), "--tmpfs", "/small"))
    line = one_error_line(small)
    assert line.startswith("error: out: /small has ") and "free; this run writes up to" in line
    roomy = dlm("train", str(cfg), "--out", "/roomy/out", "--no-progress",
                prefix=(bwrap, "--dev-bind", "/", "/", "--size", str(64 << 20), "--tmpfs", "/roomy"))
    assert roomy.returncode == 0, roomy.stderr[-3000:]


def test_checkpoint_bytes_counts_the_largest_write():
    from dlm_toolkit.training.claim import checkpoint_bytes

    assert checkpoint_bytes(1000, 4, resume_points=False) == 4000  # float32 weights
    assert checkpoint_bytes(1000, 2, resume_points=False) == 2000  # bfloat16
    # a resume point: weights + two AdamW moments in float32, next to the previous point
    assert checkpoint_bytes(1000, 4, resume_points=True) == 24000


# ------------------------------------------------------------------------------- train: one run per --out
def test_two_trains_into_one_out_the_second_is_refused_and_a_killed_run_leaves_no_claim(tmp_path, capsys):
    from dlm_toolkit.cli import main as cli_main

    out = tmp_path / "out"
    first = subprocess.Popen([*DLM, "train", str(config_file(tmp_path, "long.json", steps=1_000_000)), "--out",
                              str(out), "--no-progress"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        lock = out / ".dlm-train.lock"
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text().strip()) and time.monotonic() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.1)
        assert cli_main(["train", str(config_file(tmp_path)), "--out", str(out), "--no-progress"]) == 2  # this process
        line = capsys.readouterr().err
        assert line.startswith(f"error: out: {out} is being written by another dlm train (pid {first.pid} on ")
        assert line.count("\n") == 1
        assert first.poll() is None  # the first run goes on
        assert tree(out) == [".dlm-train.lock"]  # the second wrote nothing
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    # the kernel dropped the dead run's lock: the next run claims the folder and trains
    assert cli_main(["train", str(config_file(tmp_path)), "--out", str(out), "--no-progress"]) == 0
    assert "model.safetensors" in tree(out) and ".dlm-train.lock" not in tree(out)


# ------------------------------------------------------------------------------- the atomic writer's mode
@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_file_gets_the_mode_of_a_plain_write_under_the_umask(tmp_path, mask, mode):
    import torch

    from dlm_toolkit.models import save_model
    from dlm_toolkit.testing import tiny_llada2

    old = os.umask(mask)
    try:
        write_text(tmp_path / "a.txt", "x")
        atomic_write(tmp_path / "b.bin", lambda tmp: os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600)))
        save_model(tiny_llada2(0), tmp_path / "ckpt")
        with open(tmp_path / "plain.txt", "w") as plain:  # the independent reference
            plain.write("x")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "plain.txt").st_mode & 0o777 == mode
    for name in ("a.txt", "b.bin", "ckpt/model.safetensors", "ckpt/config.json"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == mode, name
    del torch


def test_a_replaced_file_keeps_its_own_mode(tmp_path):
    from dlm_toolkit.models import save_model
    from dlm_toolkit.testing import tiny_llada2

    for name in ("a.txt", "model.safetensors"):
        (tmp_path / name).write_text("old")
        os.chmod(tmp_path / name, 0o640)
    write_text(tmp_path / "a.txt", "new")
    save_model(tiny_llada2(0), tmp_path)
    assert (tmp_path / "a.txt").read_text() == "new"
    assert os.stat(tmp_path / "a.txt").st_mode & 0o777 == 0o640
    assert os.stat(tmp_path / "model.safetensors").st_mode & 0o777 == 0o640
    assert os.stat(tmp_path / "config.json").st_mode & 0o777 == 0o666 & ~_umask()  # new beside it: the umask's


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


# ------------------------------------------------------------------------------- two sweeps, one study
_CLAIMER = r"""
import json, sys, time
from pathlib import Path
from dlm_toolkit.config import ConfigError
from dlm_toolkit.sweep.experiment import load_experiment
from dlm_toolkit.sweep.storage import create_or_resume, open_storage
folder, me, rounds, data = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
store = open_storage(f"sqlite:///{folder}/optuna.db", heartbeat_interval=None)
for r in range(rounds):
    (folder / f"ready-{r}-{me}").touch()  # a barrier: both processes start each round together
    while len(list(folder.glob(f"ready-{r}-*"))) < 2:
        time.sleep(0.002)
    out = {}
    for kind in ("differ", "same"):
        exp = load_experiment({**data, "n": data["n"] + (4 * int(me) if kind == "differ" else 0)})
        try:
            create_or_resume(exp, store, f"{kind}-{r}")
            out[kind] = "ok"
        except ConfigError as err:
            out[kind] = str(err)
    print(json.dumps(out), flush=True)
"""


def test_two_processes_creating_one_study_at_once_exactly_one_wins(tmp_path):
    """Each round, two processes create the same new study at once: with different experiments (n 4
    and n 8) exactly one is accepted, the other refused naming the difference, and the study holds
    the winner's settings; with the same experiment both go on (the second resumes)."""
    import optuna

    from dlm_toolkit.sweep.attrs import read_settings
    from dlm_toolkit.sweep.storage import open_storage
    import sweep_helpers as h

    rounds = 6
    data = h.experiment(n=4)
    open_storage(f"sqlite:///{tmp_path}/optuna.db", heartbeat_interval=None)  # the schema exists before the race
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, str(tmp_path), str(k), str(rounds), json.dumps(data)],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        results.append([json.loads(line) for line in out.splitlines()])
    store = open_storage(f"sqlite:///{tmp_path}/optuna.db", heartbeat_interval=None)
    for r in range(rounds):
        differ = [results[k][r]["differ"] for k in (0, 1)]
        assert sorted(d == "ok" for d in differ) == [False, True], differ
        winner = differ.index("ok")
        refusal = differ[1 - winner]
        stored = (4, 8)[winner]
        assert refusal.startswith(f"study 'differ-{r}' was created with different settings (n: {stored} -> "
                                  f"{(4, 8)[1 - winner]})"), refusal
        assert read_settings(optuna.load_study(study_name=f"differ-{r}", storage=store))["n"] == stored
        assert [results[k][r]["same"] for k in (0, 1)] == ["ok", "ok"]


# ------------------------------------------------------------------------------- a storage that keeps failing
def test_a_full_disk_under_the_sqlite_store_ends_the_sweep_in_one_line_and_keeps_finished_trials(tmp_path):
    """The Optuna store on a 145 kB tmpfs: its schema and a few trials fit, then every write fails
    with "database or disk is full". The sweep stops after 3 such failures in a row (exit 2, one
    error line, no traceback, no retry loop) and the trials finished before stay in the store."""
    import sweep_helpers as h

    bwrap = shutil.which("bwrap")
    assert bwrap, "bubblewrap missing: install it with `apt-get install bubblewrap` (scripts/test.sh does)"
    f = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=4))
    count = ("import sqlite3; db = sqlite3.connect('file:/full/optuna.db?mode=ro', uri=True); "
             "print('complete', db.execute(\"select count(*) from trials where state = 'COMPLETE'\").fetchone()[0])")
    script = (f'"$@" sweep {f} --n-trials 500 --storage sqlite:////full/optuna.db --tracking-uri '
              f'{h.tracking_uri(tmp_path)} --threads 1 --no-progress --heartbeat 1; echo "rc=$?"; '
              f'{sys.executable} -c {shlex.quote(count)}')
    done = subprocess.run([bwrap, "--dev-bind", "/", "/", "--size", "145000", "--tmpfs", "/full", "sh", "-c", script,
                           "sh", *DLM], capture_output=True, text=True, env=ENV, timeout=240)
    assert "rc=2" in done.stdout, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and done.stderr.strip().splitlines()[-1] == errors[0], done.stderr[-3000:]
    assert errors[0].startswith("error: storage 'sqlite:////full/optuna.db' failed 3 times in a row with the same "
                                "error (database or disk is full) and no trial finished in between; the ")
    kept = int(errors[0].split("; the ")[1].split()[0])
    assert kept >= 1 and f"complete {kept}" in done.stdout  # the finished trials the line names are in the store
    assert sum(line.startswith("storage ") for line in done.stderr.splitlines()) == 2  # two retries, then the end


# ------------------------------------------------------------------------------- refused commands write nothing
def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_a_refused_pareto_leaves_an_empty_or_foreign_file_as_it_was(tmp_path, capsys):
    (tmp_path / "empty.db").touch()
    with sqlite3.connect(tmp_path / "other.db") as db:
        db.execute("create table notes (x)")
    (tmp_path / "text.db").write_text("not a database")
    before = _snapshot(tmp_path)
    cases = {"empty.db": "holds no Optuna study (an empty file)", "other.db": "holds no Optuna study (no Optuna tables)",
             "text.db": "is not a readable SQLite database (file is not a database)"}
    from dlm_toolkit.cli import main

    for name, says in cases.items():
        assert main(["pareto", "--storage", f"sqlite:///{tmp_path / name}", "--study-name", "t"]) == 2
        assert capsys.readouterr().err == f"error: storage 'sqlite:///{tmp_path / name}': {tmp_path / name} {says}\n"
    assert _snapshot(tmp_path) == before


def test_swapped_storage_and_tracking_urls_are_refused_before_either_store_is_written(tmp_path, capsys):
    import sweep_helpers as h

    from dlm_toolkit.config import ConfigError
    from dlm_toolkit.sweep.storage import open_storage
    from dlm_toolkit.sweep.study import run_sweep

    mlflow_uri = h.tracking_uri(tmp_path)
    optuna_uri = f"sqlite:///{tmp_path}/optuna.db"
    open_storage(optuna_uri, heartbeat_interval=None)
    before = _snapshot(tmp_path)
    exp = h.experiment(n=4)
    with pytest.raises(ConfigError) as err:
        run_sweep(exp, 1, storage=mlflow_uri, tracking_uri=optuna_uri, progress=False)
    assert str(err.value) == (f"storage '{mlflow_uri}': {tmp_path}/mlflow.db is an MLflow tracking store, not an "
                              "Optuna storage (--storage and --tracking-uri swapped?)")
    with pytest.raises(ConfigError) as err:
        run_sweep(exp, 1, storage=f"sqlite:///{tmp_path}/new.db", tracking_uri=optuna_uri, progress=False)
    assert str(err.value) == (f"tracking URI '{optuna_uri}': {tmp_path}/optuna.db is an Optuna storage, not an "
                              "MLflow tracking store (--storage and --tracking-uri swapped?)")
    from dlm_toolkit.cli import main

    assert main(["pareto", "--storage", optuna_uri, "--study-name", "t", "--tracking-uri", optuna_uri, "--log"]) == 2
    assert capsys.readouterr().err.strip().endswith("is an Optuna storage, not an MLflow tracking store "
                                                     "(--storage and --tracking-uri swapped?)")
    assert _snapshot(tmp_path) == before  # byte for byte, and no new.db left


def test_workers_start_only_after_the_stores_are_checked(tmp_path, monkeypatch):
    """--workers 10 with a storage in a missing folder: refused before any worker process starts
    (each would import torch, MLflow and Optuna first); a non-UTF-8 storage path is one line too."""
    import subprocess as sp

    import sweep_helpers as h

    from dlm_toolkit.config import ConfigError
    from dlm_toolkit.sweep import study

    started = []
    real = sp.Popen

    def spy(*args, **kwargs):
        started.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(study.subprocess, "Popen", spy)
    exp = h.experiment(n=4)
    with pytest.raises(ConfigError, match=f"storage 'sqlite:///{tmp_path}/missing/x.db': folder {tmp_path}/missing "
                                          "does not exist"):
        study.run_sweep(exp, 1, storage=f"sqlite:///{tmp_path}/missing/x.db", tracking_uri=h.tracking_uri(tmp_path),
                        workers=10, progress=False)
    assert started == []
    with pytest.raises(ConfigError, match=r"^storage: not valid UTF-8 \(byte 0xff at byte offset "):
        study.run_sweep(exp, 1, storage=f"sqlite:///{tmp_path}/\udcff.db", tracking_uri=h.tracking_uri(tmp_path),
                        workers=10, progress=False)
    assert started == [] and not list(tmp_path.glob("*.db-journal"))
    bad = dlm("sweep", str(h.write_yaml(tmp_path / "exp.yaml", exp)), "--storage",
              os.fsencode(f"sqlite:///{tmp_path}/").decode() + "\udcff.db", "--workers", "10", "--n-trials", "1",
              cwd=tmp_path)
    assert one_error_line(bad).startswith("error: storage: not valid UTF-8 (byte 0xff")
