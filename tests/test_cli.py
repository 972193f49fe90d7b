"""The dlm command: decode, --set semantics, bad input exits 2 with one line and no traceback."""

import json
import subprocess
import sys

import pytest

from dlm_toolkit.cli import main
from dlm_toolkit.models import save_model
from dlm_toolkit.testing import tiny_llada2

DLM = [sys.executable, "-m", "dlm_toolkit.cli"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_model(tiny_llada2(1), path)
    return path


def run_json(capsys, *args):
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_decode_json(ckpt, capsys):
    out = run_json(capsys, "decode", "--checkpoint", str(ckpt), "--prompt-ids", "1,2,3", "--gen-length", "20", "--json")
    assert {"tokens", "nfe", "tpf", "policy_hash"} <= set(out)
    assert out["tpf"] == pytest.approx(len(out["tokens"]) / out["nfe"])
    assert out["policy"]["m2t"]["params"]["threshold"] == 0.7  # default preset llada2.1-q


def test_set_name_resets_params_and_matches_library(ckpt, capsys):
    from dlm_toolkit import DecodingPolicy, decode
    from dlm_toolkit.models import load_model

    out = run_json(capsys, "decode", "--checkpoint", str(ckpt), "--prompt-ids", "4,5,6,7", "--gen-length", "24",
                   "--preset", "llada2.1-s", "--set", "t2t.name=none", "--json")
    assert out["policy"]["t2t"] == {"name": "none", "params": {}} and out["edits"] == 0
    lib = decode(load_model(ckpt), [[4, 5, 6, 7]], DecodingPolicy("llada2.1-s", **{"t2t.name": "none"}), 24)
    assert lib.tokens[0] == out["tokens"] and lib.rows[0].nfe == out["nfe"]
    nocache = run_json(capsys, "decode", "--checkpoint", str(ckpt), "--prompt-ids", "4,5,6,7", "--gen-length", "24",
                       "--preset", "llada2.1-s", "--set", "t2t.name=none", "--json", "--no-kv-cache")
    assert nocache["tokens"] == out["tokens"] and nocache["nfe"] == out["nfe"]


def test_policy_file(ckpt, tmp_path, capsys):
    f = tmp_path / "p.yaml"
    f.write_text("m2t: {name: topk, params: {steps_per_block: 4}}\nblocks: {name: semi_ar, params: {block_length: 4, max_post_steps: 0}}\n")
    out = run_json(capsys, "decode", "--checkpoint", str(ckpt), "--prompt-ids", "1,2,3", "--gen-length", "16", "--policy", str(f), "--json")
    assert out["policy"]["m2t"]["name"] == "topk" and out["commits"] >= len(out["tokens"])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--gen-length", "0"], "gen_length"),
        (["--gen-length", "8", "--set", "m2t.params.threshold=1.5"], "m2t.params.threshold"),
        (["--gen-length", "8", "--set", "m2t.name=bogus"], "available"),
        (["--gen-length", "8", "--set", "noequals"], "KEY=VALUE"),
        (["--gen-length", "8", "--set", "blocks.params.block_length=0"], "block_length"),
        (["--gen-length", "8", "--preset", "nope"], "unknown preset"),
        (["--gen-length", "8", "--prompt-ids-x"], None),
    ],
)
def test_bad_input_exit_2_one_line(ckpt, args, fragment):
    cmd = DLM + ["decode", "--checkpoint", str(ckpt), "--prompt-ids", "1,2,3"] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    if fragment:
        assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("ids, fragment", [("1,2,999", "outside the vocabulary"), ("1,63", "mask token"), ("a,b", "comma-separated")])
def test_bad_prompt_ids(ckpt, ids, fragment, capsys):
    assert main(["decode", "--checkpoint", str(ckpt), "--prompt-ids", ids, "--gen-length", "8"]) == 2
    assert fragment in capsys.readouterr().err


def test_prompt_text_needs_tokenizer(ckpt, capsys):
    assert main(["decode", "--checkpoint", str(ckpt), "--prompt", "hi", "--gen-length", "8"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err


def test_every_subcommand_has_help():
    from dlm_toolkit.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name, parser in sub.items():
        assert parser.format_help().startswith("usage: dlm " + name)


def test_strategies_list_json(capsys):
    info = run_json(capsys, "strategies", "list", "--json")
    names = {e["name"] for e in info["roles"]["m2t"]}
    assert {"threshold", "topk"} <= names
    thr = next(e for e in info["roles"]["m2t"] if e["name"] == "threshold")
    assert thr["source"] == "built-in" and thr["fields"][0]["range"] == "0.0 < x <= 1.0"
