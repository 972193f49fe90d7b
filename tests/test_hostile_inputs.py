"""The second hostile table (issue 27): absurd config dimensions, deep JSON, bytes that are not
UTF-8, a million threads, FIFOs and devices as files, a billion instances, tampered study stores,
and commands that fail leaving files behind. Every row: exit 2, one line naming the field or the
file, nothing written, nothing lost, no hang."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

import sweep_helpers as h
from dlm_toolkit.cli import main
from test_hostile_cli import IDS, TESTBED, TINY, make, run_cli

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(autouse=True)
def no_hang():
    """A row that blocks (a FIFO opened for reading) fails the test instead of hanging the suite."""
    def hung(signum, frame):
        raise TimeoutError("the command hung")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------------- checkpoints
CONFIG_ROWS = {  # name -> (config change, what the one line must name)
    "head_dim 1e9": ({"head_dim": 10**9}, "head_dim=1000000000 imply model.layers.0.attention.query_layernorm.weight"),
    "heads 1e12": ({"num_attention_heads": 10**12}, "num_attention_heads=1000000000000, head_dim=16 imply"),
    "kv heads 1e9": ({"num_key_value_heads": 10**9, "num_attention_heads": 10**9},
                     "num_attention_heads=1000000000, head_dim=16 imply"),
    "dense width 1e10": ({"intermediate_size": 10**10}, "intermediate_size=10000000000 imply model.layers.0.mlp.gate_proj"),
    "expert width 1e11": ({"moe_intermediate_size": 10**11}, "moe_intermediate_size=100000000000 imply"),
    "shared experts 1e9": ({"num_shared_experts": 10**9}, "num_shared_experts=1000000000 imply"),
}


@pytest.mark.parametrize("row", sorted(CONFIG_ROWS))
def test_config_dimensions_are_checked_against_the_shard_shapes(row, tmp_path, capsys):
    change, needle = CONFIG_ROWS[row]
    d = make(tmp_path, "ckpt", config=lambda c: {**c, **change})
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS],
                   capsys, tmp_path)
    assert "config does not match the weights" in line and needle in line, line


def test_the_parameters_the_config_implies_must_fit_in_memory(tmp_path, capsys, monkeypatch):
    from safetensors import safe_open

    from dlm_toolkit.models import validate

    monkeypatch.setattr(validate, "available_memory", lambda device: (50_000, "MemAvailable of this machine"))
    line = run_cli(["decode", "--checkpoint", str(TINY), "--prompt-ids", "1,2", "--gen-length", "4", *IDS],
                   capsys, tmp_path)
    with safe_open(TINY / "model.safetensors", "pt") as f:  # the count of the real weights: the bound is exact
        params = sum(__import__("math").prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert f"the config implies {params:,} parameters, {params * 4 / 1e9:.2f} GB in float32, more than the " \
           "0.00 GB MemAvailable of this machine" in line, line


@pytest.mark.parametrize("where", ["config.json", "model.safetensors.index.json"])
def test_json_nested_100000_deep_is_refused(where, tmp_path, capsys):
    d = make(tmp_path, "ckpt", index={"weight_map": {}} if where != "config.json" else None)
    (d / where).write_text('{"a": ' + DEEP + "}")
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt-ids", "1", "--gen-length", "4", *IDS], capsys, tmp_path)
    assert f"{where}: JSON nested 100001 levels deep; at most 64 are accepted" in line


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_special_files_in_a_checkpoint_are_refused_before_reading(name, tmp_path, capsys):
    d = make(tmp_path, "ckpt", src=TESTBED)
    (d / name).unlink()
    os.mkfifo(d / name)
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt", "sort:1=", "--gen-length", "4"], capsys, tmp_path)
    assert f"{name}: a " in line and "must be a regular file, this is a FIFO" in line


# ----------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("command,needle", [
    (["decode", "--checkpoint", str(TESTBED), "--prompt", b"sort:\xff12=".decode("utf-8", "surrogateescape"),
      "--gen-length", "4"], "--prompt: not valid UTF-8 (byte 0xff at byte offset 5)"),
    (["decode", "--checkpoint", str(TESTBED), "--prompt", "é" + b"\xc3(".decode("utf-8", "surrogateescape"),
      "--gen-length", "4"], "(byte 0xc3 at byte offset 2)"),
    (["decode", "--checkpoint", str(TESTBED), "--prompt", "sort:1=", "--gen-length", "4", "--threads", "1000000"],
     f"threads: must be an integer in [1, {os.cpu_count()}] (this machine has {os.cpu_count()} CPUs), got 1000000"),
    (["eval", "--checkpoint", str(TESTBED), "--task", "add", "--n", "4", "--threads", "1000000"], "threads"),
    (["train", str(Path(__file__).parents[1] / "experiments/train/editable.yaml"), "--out", "{tmp}/o",
      "--threads", "1000000"], "threads: must be an integer in [1,"),
    (["eval", "--checkpoint", str(TESTBED), "--task", "add", "--n", "1000000000"],
     "n: 1000000000 is more than 100000, the most instances of generated task 'add' one evaluation decodes"),
    (["eval", "--checkpoint", str(TESTBED), "--task", "humaneval", "--n", "1000"],
     "n: 1000 is more than the 164 eval instances task 'humaneval' has"),
])
def test_arguments(command, needle, tmp_path, capsys):
    line = run_cli([a.replace("{tmp}", str(tmp_path)) for a in command], capsys, tmp_path)
    assert needle in line, line


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom", "folder", "deep", "big"])
@pytest.mark.parametrize("as_", ["policy", "experiment", "train config"])
def test_special_and_oversized_files_as_policy_experiment_or_config(kind, as_, tmp_path, capsys):
    path = tmp_path / ("p.json" if as_ == "policy" else "e.yaml" if as_ == "experiment" else "t.json")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "deep":
        path.write_text('{"a": ' + DEEP + "}" if path.suffix == ".json" else "a: " + DEEP)
    elif kind == "big":
        path.write_text(" " * (1 << 20) + "{}")
    else:
        path.symlink_to(kind)
    command = {"policy": ["decode", "--checkpoint", str(TESTBED), "--prompt", "sort:1=", "--gen-length", "4",
                          "--policy", str(path)],
               "experiment": ["sweep", str(path), "--storage", f"sqlite:///{tmp_path}/o.db",
                              "--tracking-uri", f"sqlite:///{tmp_path}/m.db"],
               "train config": ["train", str(path), "--out", str(tmp_path / "out")]}[as_]
    line = run_cli(command, capsys, tmp_path)
    expect = {"fifo": "must be a regular file, this is a FIFO", "/dev/zero": "this is a character device",
              "/dev/urandom": "this is a character device", "folder": "this is a folder",
              "deep": "nested", "big": "a config file is limited to 1048576 bytes"}[kind]
    assert str(path) in line and expect in line, line


def test_an_experiment_asking_for_a_billion_instances_is_refused(tmp_path, capsys):
    exp = h.write_yaml(tmp_path / "exp.yaml", h.experiment(n=10**9))
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/o.db"], capsys, tmp_path)
    assert "n: 1000000000 is more than 100000" in line


# ----------------------------------------------------------------------------------------------- study stores
@pytest.fixture(scope="module")
def store_template(tmp_path_factory) -> Path:
    """A study as `dlm sweep` leaves it: settings, one COMPLETE trial with policy, hashes, metrics, outcomes."""
    import optuna

    from dlm_toolkit.strategy.policy_config import load_policy
    from dlm_toolkit.sweep.attrs import write_settings
    from dlm_toolkit.sweep.experiment import load_experiment

    folder = tmp_path_factory.mktemp("store")
    exp = load_experiment(h.experiment())
    study = optuna.create_study(storage=f"sqlite:///{folder / 'optuna.db'}", study_name="s",
                                directions=exp.directions)
    write_settings(study, exp.settings())
    policy = load_policy("llada2.1-q")
    study.add_trial(optuna.trial.create_trial(
        values=[0.5, 1.5], params={}, distributions={},
        user_attrs={"policy": policy.canonical_json(), "policy_hash": policy.config_hash(), "plugin_hashes": {},
                    "metrics": {"accuracy": 0.5, "tpf": 1.5, "n": 8}, "outcomes": "8:f0"}))
    return folder / "optuna.db"


def set_attr(db: Path, key: str, value_json: str, trial: bool = False) -> None:
    """Write ``value_json`` as the stored JSON of attribute ``key``, straight into the database."""
    table = "trial_user_attributes" if trial else "study_user_attributes"
    with sqlite3.connect(db) as con:
        assert con.execute(f"UPDATE {table} SET value_json = ? WHERE key = ?", (value_json, key)).rowcount == 1


def set_settings(db: Path, text: str) -> None:
    """Replace the stored settings by ``text`` in one part."""
    with sqlite3.connect(db) as con:
        con.execute("DELETE FROM study_user_attributes WHERE key LIKE 'experiment.%' AND key != 'experiment.0' "
                    "AND key != 'experiment.parts'")
    set_attr(db, "experiment.0", json.dumps(text))
    set_attr(db, "experiment.parts", "1")


def stored_settings(db: Path) -> dict:
    with sqlite3.connect(db) as con:
        parts = dict(con.execute("SELECT key, value_json FROM study_user_attributes"))
    count = json.loads(parts["experiment.parts"])
    return json.loads("".join(json.loads(parts[f"experiment.{i}"]) for i in range(count)))


def settings_with(**changes):
    return lambda db: set_settings(db, json.dumps({**stored_settings(db), **changes}))


BOTH, REPLAY, PARETO = ("replay", "pareto"), ("replay",), ("pareto",)
STORE_ROWS = {  # name -> (how to tamper, commands that read it, what the one line must name)
    "settings are a list": (lambda db: set_settings(db, "[1, 2]"), BOTH, "must be an object, got list"),
    "settings are a number": (lambda db: set_settings(db, "7"), BOTH, "must be an object, got int"),
    "a billion parts": (lambda db: set_attr(db, "experiment.parts", "1000000000"), BOTH,
                        "experiment.parts must be an integer in [1,"),
    "parts is a string": (lambda db: set_attr(db, "experiment.parts", '"2"'), BOTH, "experiment.parts must be an integer"),
    "n of a billion": (settings_with(n=10**9), BOTH, "n: 1000000000 is more than 100000"),
    "unknown task_args": (settings_with(task_args={"bogus": 1}), BOTH,
                          "task_args: got an unexpected keyword argument 'bogus'"),
    "unknown task": (settings_with(task="nope"), BOTH, "unknown task 'nope'"),
    "objectives are a list": (settings_with(objectives=["accuracy"]), BOTH, "objectives"),
    "settings nested deep": (lambda db: set_settings(db, '{"a": ' + DEEP + "}"), BOTH, "nested 100001 levels deep"),
    "an attribute nested deep": (lambda db: set_attr(db, "experiment.0", DEEP), BOTH, "nested too deeply to read"),
    "policy is a list": (lambda db: set_attr(db, "policy", json.dumps("[]"), True), REPLAY,
                         "trial 0: attribute policy must hold a JSON object"),
    "policy is a number": (lambda db: set_attr(db, "policy", "5", True), REPLAY,
                           "trial 0: attribute policy must be a JSON string"),
    "policy nested deep": (lambda db: set_attr(db, "policy", json.dumps("[" * 5000 + "]" * 5000), True), REPLAY,
                           "nested 5000 levels deep"),
    "plug-in hashes are a list": (lambda db: set_attr(db, "plugin_hashes", "[]", True), REPLAY,
                                  "attribute plugin_hashes must be an object of strings"),
    "metrics are a list": (lambda db: set_attr(db, "metrics", "[1]", True), BOTH,
                           "attribute metrics must be an object of numbers"),
    "outcomes of a billion": (lambda db: set_attr(db, "outcomes", '"1000000000:ff"', True), PARETO,
                              "attribute outcomes must be '<n>:<hex>'"),
}
CASES = [(row, command) for row in sorted(STORE_ROWS) for command in STORE_ROWS[row][1]]


@pytest.mark.parametrize("row,command", CASES)
def test_a_tampered_study_store_is_refused(row, command, store_template, tmp_path, capsys):
    how, _, needle = STORE_ROWS[row]
    db = tmp_path / "optuna.db"
    shutil.copy(store_template, db)
    how(db)
    before = snapshot(tmp_path)
    args = {"replay": ["replay", "--trial", "0"], "pareto": ["pareto", "--json"]}[command]
    line = run_cli([*args, "--storage", f"sqlite:///{db}", "--study-name", "s"], capsys, tmp_path)
    assert needle in line, line
    assert snapshot(tmp_path) == before  # the store is read, never repaired or rewritten


def test_the_untampered_store_reads(store_template, tmp_path, capsys):
    """The rows above fail because of what they change: the template itself is accepted."""
    db = tmp_path / "optuna.db"
    shutil.copy(store_template, db)
    assert main(["pareto", "--json", "--storage", f"sqlite:///{db}", "--study-name", "s"]) == 0
    assert json.loads(capsys.readouterr().out)["front"]


# ----------------------------------------------------------------------------------------------- leftovers
def test_a_refused_command_leaves_no_store_and_no_lock_file(tmp_path, capsys):
    foreign = tmp_path / "notes.md"
    foreign.write_text("not a database")
    run_cli(["pareto", "--storage", f"sqlite:///{foreign}", "--study-name", "x"], capsys, tmp_path)
    run_cli(["replay", "--storage", f"sqlite:///{foreign}", "--study-name", "x", "--trial", "0"], capsys, tmp_path)
    exp = h.write_yaml(tmp_path / "exp.yaml", h.experiment())
    before = snapshot(tmp_path)
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/new.db", "--tracking-uri",
                    "http://127.0.0.1:9", "--no-progress", "--n-trials", "2"], capsys, tmp_path)
    assert "tracking URI 'http://127.0.0.1:9'" in line
    assert snapshot(tmp_path) == before  # no new.db (the storage was created, then removed unused)
