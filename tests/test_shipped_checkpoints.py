"""The shipped testbed checkpoints load, carry model cards, fit the size budget and still score."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"
NAMES = ("testbed-editable", "testbed-maskonly", "testbed-v2-editable", "testbed-v2-maskonly")
PRESETS = ("llada2.1-q", "llada2.1-s", "llada2.1-s+t2t.name=none", "llada2.0")


def test_total_size_within_budget():
    total = sum(f.stat().st_size for name in NAMES for f in (ROOT / name).rglob("*") if f.is_file())
    assert total <= 25 * 2**20, f"{total / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_loads_and_has_a_card(name):
    folder = ROOT / name
    model, tok = load_checkpoint(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llada2_moe"
    assert (model.mask_token_id, model.eos_token_id) == (config["mask_token_id"], config["eos_token_id"])
    card = (folder / "README.md").read_text()
    table = json.loads((folder / "evaluation.json").read_text())
    assert table["n"] >= 100 and table["seed"] == 0
    for preset in PRESETS:
        assert preset in table["results"] and preset in card
        for task in ("add", "sort", "sudoku"):
            acc = table["results"][preset][task]["accuracy"]
            assert f"{acc:.3f}" in card
    for words in ("dlm train", "wall time", "steps", "corrupt_rate"):
        assert words in card
    assert json.loads((folder / "training.json").read_text())["steps"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_quick_eval_matches_the_card(name):
    folder = ROOT / name
    model, tok = load_checkpoint(folder)
    card_acc = json.loads((folder / "evaluation.json").read_text())["results"]["llada2.1-q"]["add"]["accuracy"]
    res = evaluate(model, tok, "add", "llada2.1-q", n=20, seed=0, progress=False)
    assert res.metrics["accuracy"] >= card_acc - 0.15, (res.metrics, card_acc)
