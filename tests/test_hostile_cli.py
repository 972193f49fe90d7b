"""Hostile input through every command: exit 2, one line naming the problem, no traceback,
nothing read outside the checkpoint folder, nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm_toolkit.cli import main
from dlm_toolkit.models import CheckpointError, load_model

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "conformance" / "llada2_tiny"
TESTBED = REPO / "checkpoints" / "testbed-editable"
IDS = ["--mask-id", "127", "--eos-id", "126"]


def make(tmp: Path, name: str, *, config=None, weights=None, index=None, src: Path = TINY) -> Path:
    d = tmp / name
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("cases.json", "logits.safetensors", "README.md"))
    if config is not None:
        (d / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    if weights is not None or index is not None:
        w = load_file(str(src / "model.safetensors"))
        w = weights(w) if weights else w
        (d / "model.safetensors").unlink()
        if index is None:
            save_file(w, str(d / "model.safetensors"))
        else:
            save_file(w, str(d / "shard.safetensors"))
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def run_cli(args: list[str], capsys, root: Path) -> str:
    before = listing(root)
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in captured.err, captured.err
    assert listing(root) == before, "a refused command must write nothing"
    return err[0]


CHECKPOINT_CASES = {  # name -> (how to break the tiny checkpoint, what the message must name)
    "config_is_a_list": (dict(config=lambda c: [c]), "must hold a JSON object"),
    "vocab_1e12": (dict(config=lambda c: {**c, "vocab_size": 10**12}), "vocab_size=1000000000000"),
    "layers_1e6": (dict(config=lambda c: {**c, "num_hidden_layers": 10**6}), "num_hidden_layers=1000000"),
    "experts_mismatch": (dict(config=lambda c: {**c, "num_experts": 16, "n_group": 4}), "num_experts=16"),
    "index_is_a_list": (dict(index={"weight_map": ["shard.safetensors"]}), "'weight_map' must be an object"),
    "index_non_string": (dict(index={"weight_map": {"model.word_embeddings.weight": 3}}), "not file names"),
    "index_parent": (dict(index={"weight_map": {"model.word_embeddings.weight": "../outside.safetensors"}}),
                     "'../outside.safetensors' resolves outside"),
    "index_absolute": (dict(index={"weight_map": {"model.word_embeddings.weight": "/etc/passwd"}}),
                       "'/etc/passwd' resolves outside"),
    "int_weights": (dict(weights=lambda w: {k: (v * 100).long() if k.endswith("dense.weight") else v for k, v in w.items()}),
                    "model.layers.0.attention.dense.weight (I64)"),
    "bool_weights": (dict(weights=lambda w: {k: v > 0 if k.endswith("query_key_value.weight") else v for k, v in w.items()}),
                     "(BOOL)"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_broken_checkpoints_fail_fast_with_one_line(case, tmp_path, capsys):
    how, needle = CHECKPOINT_CASES[case]
    d = make(tmp_path, case, **how)
    (tmp_path / "outside.safetensors").write_bytes((TINY / "model.safetensors").read_bytes())
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS], capsys, tmp_path)
    assert needle in line
    line = run_cli(["eval", "--checkpoint", str(d), "--task", "sort", "--n", "2"], capsys, tmp_path)
    assert needle in line or "tokenizer" in line


def test_mask_equal_to_eos_is_refused(tmp_path, capsys):
    d = make(tmp_path, "same_ids", config=lambda c: {**c, "mask_token_id": 126, "eos_token_id": 126})
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt-ids", "1,2", "--gen-length", "8"], capsys, tmp_path)
    assert "mask_token_id and eos_token_id must differ" in line


def test_symlink_out_of_the_folder_is_refused(tmp_path, capsys):
    d = make(tmp_path, "linked", src=TESTBED)
    (d / "tokenizer.json").unlink()
    os.symlink(REPO / "checkpoints" / "testbed-maskonly" / "tokenizer.json", d / "tokenizer.json")
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt", "sort:12,11=", "--gen-length", "8"], capsys, tmp_path)
    assert "'tokenizer.json' resolves outside the checkpoint folder" in line
    (d / "model.safetensors").unlink()
    os.symlink(TESTBED / "model.safetensors", d / "model.safetensors")
    with pytest.raises(CheckpointError, match="weights file 'model.safetensors' resolves outside"):
        load_model(d)


def test_broken_tokenizer_is_named(tmp_path, capsys):
    d = make(tmp_path, "badtok", src=TESTBED)
    (d / "tokenizer.json").write_text('{"model": {')
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt", "sort:1=", "--gen-length", "8"], capsys, tmp_path)
    assert "tokenizer.json: not a readable tokenizer" in line


def test_nan_weights_stop_the_decode_and_the_scan_names_them(tmp_path, capsys):
    d = make(tmp_path, "nan", weights=lambda w: {k: torch.full_like(v, float("nan")) for k, v in w.items()})
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS], capsys, tmp_path)
    assert "non-finite logits" in line and "forward 1" in line and "row 0" in line
    with pytest.raises(CheckpointError, match="NaN or infinity"):
        load_model(d, mask_token_id=127, eos_token_id=126, check_finite=True)
    shutil.copy(TINY / "cases.json", d / "cases.json")
    assert "NaN or infinity" in run_cli(["conformance", str(d)], capsys, tmp_path)


@pytest.mark.parametrize("args,needle", [
    (["--gen-length", "1000000000"], "gen_length: must be an integer in [1, 1048576]"),
    (["--gen-length", "5000"], "max_position_embeddings"),
    (["--gen-length", "8", "--set", "sampling.temperature.x=1"], "'temperature' is a value, not a group"),
    (["--gen-length", "8", "--threads", "0"], "threads"),
    (["--gen-length", "8", "--device", "cuda:7"], "device"),
    (["--gen-length", "8", "--dtype", "int8"], "dtype"),
    (["--gen-length", "-3"], "gen_length"),
])
def test_decode_arguments(args, needle, tmp_path, capsys):
    line = run_cli(["decode", "--checkpoint", str(TESTBED), "--prompt", "sort:12,11=", *args], capsys, tmp_path)
    assert needle in line


def test_past_context_override_decodes(capsys):
    args = ["decode", "--checkpoint", str(TESTBED), "--prompt", "sort:12,11=", "--gen-length", "260", "--preset", "llada2.0"]
    assert main(args + ["--allow-past-context", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nfe"] >= 1


@pytest.mark.parametrize("command", [
    ["eval", "--checkpoint", "{bad}", "--task", "sort", "--n", "3"],
    ["eval", "--checkpoint", str(TESTBED), "--task", "sort", "--n", "3", "--set", "m2t.params.threshold=2"],
    ["conformance", "{bad}"],
    ["sweep", "{tmp}/missing.yaml"],
    ["pareto", "--storage", "sqlite:///{tmp}/none.db", "--study-name", "x"],
    ["replay", "--storage", "sqlite:///{tmp}/none.db", "--study-name", "x", "--trial", "0"],
    ["train", "{tmp}/missing.yaml", "--out", "{tmp}/out"],
    ["compare", "--checkpoint", "{bad}", "--task", "sort", "--n", "3"],
])
def test_every_command_refuses_a_broken_input(command, tmp_path, capsys):
    bad = make(tmp_path, "bad", config=lambda c: [c])
    args = [a.replace("{bad}", str(bad)).replace("{tmp}", str(tmp_path)) for a in command]
    run_cli(args, capsys, tmp_path)


def test_a_real_bug_keeps_its_traceback(monkeypatch):
    import dlm_toolkit.cli as cli
    import dlm_toolkit.commands.decode as decode_command

    def boom(args):
        raise KeyError("a bug, not bad input")

    monkeypatch.setattr(decode_command, "cmd_decode", boom)
    with pytest.raises(KeyError):
        cli.main(["decode", "--checkpoint", ".", "--prompt-ids", "1", "--gen-length", "1"])
