"""Bounded parsing and the import opt-in: YAML bombs, huge grids, class paths from files and stores."""

from __future__ import annotations

import sys

import pytest

import sweep_helpers as h
from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError, read_mapping_file
from dlm_toolkit.sweep import load_experiment

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"


def test_yaml_aliases_and_huge_files_are_refused(tmp_path):
    (tmp_path / "bomb.yaml").write_text(BOMB)
    with pytest.raises(ConfigError, match=r"bomb.yaml:1: YAML anchors and aliases"):
        read_mapping_file(tmp_path / "bomb.yaml")
    (tmp_path / "big.yaml").write_text("x: " + "1" * (1 << 20))
    with pytest.raises(ConfigError, match="limited to 1048576 bytes"):
        read_mapping_file(tmp_path / "big.yaml")
    (tmp_path / "exp.yaml").write_text(BOMB)
    assert main(["sweep", str(tmp_path / "exp.yaml")]) == 2
    assert main(["train", str(tmp_path / "exp.yaml"), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("space,sampler,needle", [
    ({"m2t.params.threshold": {"float": [0.01, 0.99], "step": 1e-12}}, "random", "more than 100000"),
    ({"sampling.top_k": {"int": [0, 10**9]}}, "grid", "more than 100000"),
    ({"m2t.params.threshold": {"float": [0.01, 0.99], "step": 0.0001},
      "t2t.params.threshold": {"float": [0.0, 0.99], "step": 0.0001}}, "grid", "more than 1000000"),
])
def test_search_space_sizes_are_checked_before_enumeration(space, sampler, needle):
    with pytest.raises(ConfigError, match=needle):
        load_experiment(h.experiment(search_space=space, sampler={"name": sampler, "seed": 0}))


def test_class_paths_need_the_opt_in_and_import_nothing_before(tmp_path, capsys, monkeypatch):
    (tmp_path / "planted_rule.py").write_text(
        f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n"
        "from strategies.m2t_threshold import ThresholdUnmask as Rule\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt = str(h.REPO / "checkpoints" / "testbed-editable")
    args = ["decode", "--checkpoint", ckpt, "--prompt", "sort:1=", "--gen-length", "4", "--set", "m2t.name=planted_rule:Rule"]
    assert main(args) == 2
    assert "would import module 'planted_rule'" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists() and "planted_rule" not in sys.modules
    assert main([*args, "--allow-import"]) == 0
    assert (tmp_path / "ran").exists()
