"""README's smoke lines: every benchmark pipeline runs end to end on the shipped long-context smoke
checkpoint (random weights), and the checkpoint is what its generator script writes."""

from __future__ import annotations

import json
import re
import shlex
import runpy
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dlm_toolkit.cli import main

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "checkpoints" / "smoke-long"


def smoke_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("**Smoke versions on a CPU, before any download.**", 1)[1].split("```bash\n", 1)[1]
    return [line for line in block.split("```", 1)[0].splitlines() if line.strip()]


def test_the_block_covers_every_benchmark_with_a_file_format():
    tasks = {re.search(r"--task (\S+)", line).group(1) for line in smoke_lines()}
    assert tasks == {"gsm8k", "math500", "mbpp", "humaneval_plus", "mbpp_plus", "livecodebench", "bigcodebench"}


@pytest.mark.parametrize("line", smoke_lines(), ids=lambda line: re.search(r"--task (\S+)", line).group(1))
def test_readme_smoke_line_runs_the_whole_pipeline(line, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    argv = shlex.split(line)
    assert argv[0] == "dlm"
    assert main(argv[1:] + ["--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == int(argv[argv.index("--n") + 1]) and report["tpf"] > 0 and len(report["instances"]) == report["n"]
    assert all(row["tokens"] > 0 for row in report["instances"])


def test_the_checkpoint_is_what_its_script_writes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "smoke"
    monkeypatch.setattr(sys, "argv", ["make_smoke_checkpoint.py", str(out)])
    runpy.run_path(str(REPO / "experiments" / "smoke" / "make_smoke_checkpoint.py"), run_name="__main__")
    shipped, made = load_file(SMOKE / "model.safetensors"), load_file(out / "model.safetensors")
    assert shipped.keys() == made.keys() and all(shipped[k].equal(made[k]) for k in shipped)
    assert json.loads((out / "config.json").read_text()) == json.loads((SMOKE / "config.json").read_text())
    assert json.loads((SMOKE / "config.json").read_text())["max_position_embeddings"] >= 8192


def test_a_fixture_folder_short_of_release_v6_names_the_releases_it_holds(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["eval", "--checkpoint", str(SMOKE), "--task", "livecodebench", "--data", "tests/fixtures/livecodebench",
                 "--n", "1", "--gen-length", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "release_v6 needs" in err
    assert "make up release_v1, release_v2, v1, v2, v1_v2" in err and "--task-arg release_version=NAME" in err
