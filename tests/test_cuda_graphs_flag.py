"""``--cuda-graphs/--no-cuda-graphs`` on every decoding command, the experiment key ``cuda_graphs``,
and the value reaching ``decode()`` through ``evaluate()``.

On a CPU machine the checks that run are the refusals (one line, before any work) and the
plumbing (``cuda_graphs=True`` reaches ``decode()``, which refuses a CPU model); the GPU runs of
the flag are in benchmarks/gpu_session.sh.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlm_toolkit.cli import build_parser, main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.models import save_model
from dlm_toolkit.testing import tiny_llada2
from tests.sweep_helpers import experiment, write_yaml

TESTBED = Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-editable"
COMMANDS = {
    "decode": ["decode", "--checkpoint", "c", "--prompt-ids", "1", "--gen-length", "4"],
    "eval": ["eval", "--checkpoint", "c", "--task", "add", "--n", "1"],
    "compare": ["compare", "--checkpoint", "c", "--task", "add", "--n", "1", "--a", "llada2.1-q", "--b", "llada2.1-s"],
    "sweep": ["sweep", "e.yaml"],
    "replay": ["replay", "--study-name", "s", "--trial", "0"],
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_model(tiny_llada2(1), path)
    return path


@pytest.mark.parametrize("name", COMMANDS)
def test_flag_parses_on_every_decoding_command(name):
    parser = build_parser()
    argv = COMMANDS[name]
    assert parser.parse_args(argv).cuda_graphs is None  # auto: on for CUDA devices
    assert parser.parse_args([*argv, "--cuda-graphs"]).cuda_graphs is True
    assert parser.parse_args([*argv, "--no-cuda-graphs"]).cuda_graphs is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
@pytest.mark.parametrize("name", ["decode", "eval", "compare", "replay"])
def test_cuda_graphs_on_cpu_is_one_line_before_any_work(name, capsys):
    # the checkpoint "c" does not exist: the refusal comes first, before anything is read
    assert main([*COMMANDS[name], "--cuda-graphs"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --cuda-graphs needs a CUDA device (--device cuda); this run is on cpu\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_sweep_refuses_flag_and_experiment_key_on_cpu(tmp_path, capsys):
    path = write_yaml(tmp_path / "e.yaml", experiment("missing-checkpoint", cuda_graphs=True))
    assert main(["sweep", str(path), "--storage", f"sqlite:///{tmp_path}/s.db"]) == 2
    err = capsys.readouterr().err
    assert err == "error: cuda_graphs: true needs a CUDA device (--device cuda); this run is on cpu\n"
    path = write_yaml(tmp_path / "f.yaml", experiment("missing-checkpoint"))
    assert main(["sweep", str(path), "--cuda-graphs"]) == 2
    assert "error: --cuda-graphs needs a CUDA device" in capsys.readouterr().err


def test_experiment_key_values(tmp_path):
    from dlm_toolkit.sweep.experiment import load_experiment

    for value in (True, False, None):
        exp = load_experiment(write_yaml(tmp_path / "e.yaml", experiment(cuda_graphs=value)))
        assert exp.cuda_graphs is value
        assert "cuda_graphs" not in exp.result_settings()  # graphs change timing only: a study may resume
    with pytest.raises(ConfigError, match="cuda_graphs"):
        load_experiment(write_yaml(tmp_path / "e.yaml", experiment(cuda_graphs="sometimes")))


def test_no_cuda_graphs_decodes_the_same_tokens(ckpt, capsys):
    import json

    argv = ["decode", "--checkpoint", str(ckpt), "--prompt-ids", "1,2,3", "--gen-length", "8", "--json"]
    outs = []
    for flag in ([], ["--no-cuda-graphs"]):
        assert main([*argv, *flag]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["tokens"] == outs[1]["tokens"] and outs[0]["nfe"] == outs[1]["nfe"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_evaluate_passes_cuda_graphs_to_decode():
    # the real decode() refuses graphs for a CPU model: the value made it through evaluate/generate
    from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint

    model, tok = load_checkpoint(TESTBED)
    with pytest.raises(ConfigError, match="cuda_graphs needs a CUDA device"):
        evaluate(model, tok, "add", "llada2.1-q", 1, cuda_graphs=True, progress=False)
    assert evaluate(model, tok, "add", "llada2.1-q", 1, cuda_graphs=False, progress=False).metrics["n"] == 1
