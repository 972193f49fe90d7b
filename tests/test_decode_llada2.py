"""Decoding the native LLaDA2 MoE: exact KV cache, batch invariance, multi-block editing."""

import json
import random
from pathlib import Path

import pytest
import torch

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.cli import main
from dlm_toolkit.testing import tiny_llada2


def policies(block_length):
    common = {"blocks.params.block_length": block_length}
    return [
        DecodingPolicy("llada2.1-s", **common),
        DecodingPolicy("llada2.1-q", **common, **{"blocks.params.max_post_steps": 2}),
        DecodingPolicy("llada2.0", **common),
        DecodingPolicy("llada2.1-s", **common, **{"blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 2}),
        DecodingPolicy("llada-lowconf", **common, **{"m2t.params.steps_per_block": max(1, block_length // 2)}),
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_cache_gives_identical_tokens_and_nfe(seed):
    rng = random.Random(seed)
    model = tiny_llada2(seed)
    block = rng.choice([4, 8, 16])
    prompts = [[rng.randrange(0, 60) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    for pol in policies(block):
        cached = decode(model, prompts, pol, 24, kv_cache=True)
        plain = decode(model, prompts, pol, 24, kv_cache=False)
        assert cached.tokens == plain.tokens, pol
        assert [r.nfe for r in cached.rows] == [r.nfe for r in plain.rows]
        assert [r.edits for r in cached.rows] == [r.edits for r in plain.rows]
        # the cache must actually save work
        assert sum(r.forward_tokens for r in cached.rows) < sum(r.forward_tokens for r in plain.rows)


@pytest.mark.parametrize("kv", [True, False])
def test_batch_of_different_prompt_lengths_equals_single_decodes(kv):
    model = tiny_llada2(4)
    prompts = [[1, 2, 3], [5] * 13, [7, 8], [9] * 30, [11, 12, 13, 14, 15, 16, 17, 18]]
    for pol in policies(8)[:4]:
        batch = decode(model, prompts, pol, 20, kv_cache=kv)
        for i, p in enumerate(prompts):
            alone = decode(model, [p], pol, 20, kv_cache=kv)
            assert batch.tokens[i] == alone.tokens[0], (pol, i)
            assert batch.rows[i].nfe == alone.rows[0].nfe


def test_mbe_with_zero_blocks_is_semi_ar_and_costs_compute_otherwise():
    model = tiny_llada2(5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    base = {"blocks.params.block_length": 8, "blocks.params.eos_early_stop": False}
    semi = decode(model, prompts, DecodingPolicy("llada2.1-s", **base), 40)
    mbe0 = decode(model, prompts, DecodingPolicy("llada2.1-s", **base, **{"blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 0}), 40)
    assert semi.tokens == mbe0.tokens and [r.forward_tokens for r in semi.rows] == [r.forward_tokens for r in mbe0.rows]
    mbe2 = decode(model, prompts, DecodingPolicy("llada2.1-s", **base, **{"blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 2}), 40, record=True)
    assert sum(r.forward_tokens for r in mbe2.rows) > sum(r.forward_tokens for r in semi.rows)
    # edits reached earlier blocks
    block_of = lambda pos: pos // 8  # noqa: E731
    assert any(block_of(e) < s.block for s in mbe2.trajectory.steps for e in s.edit)


def test_conformance_command_passes_on_the_shared_fixtures(fixture_dir, capsys):
    import json

    assert main(["conformance", str(fixture_dir)]) == 0
    summary, last = capsys.readouterr().out.strip().splitlines()[-2:]
    cases = json.loads((fixture_dir / "cases.json").read_text())["cases"]
    values = sum(len(c["expected"]) for c in cases)
    traced = sum(len(c["trace"]) for c in cases)
    assert summary == (f"2 logits checks, {2 * len(cases)} decodes ({len(cases)} cases x 2 KV modes): "
                       f"{2 * values} expected values and {2 * traced} traced forwards compared")
    assert last == f"{2 + 2 * len(cases)} passed, 0 failed"


def _fixture_copy(fixture_dir, tmp_path, edit):
    import json
    import shutil

    copy = tmp_path / "fx"
    shutil.copytree(fixture_dir, copy)
    (copy / "cases.json").chmod(0o644)
    spec = json.loads((copy / "cases.json").read_text())
    edit(spec["cases"])
    (copy / "cases.json").write_text(json.dumps(spec))
    return copy


@pytest.mark.parametrize("device, code, fragment", [
    ("cpu", 0, "36 passed, 0 failed"),
    ("cuda:99" if torch.cuda.is_available() else "cuda", 2, "CUDA" if not torch.cuda.is_available() else "cuda:99"),
    ("tpu", 2, "device"),
])
def test_conformance_runs_on_the_device_it_is_given(fixture_dir, capsys, device, code, fragment):
    """``--device`` reaches the model (checked against the goldens on an H200: 36 of 36 pass in fp32)."""
    assert main(["conformance", str(fixture_dir), "--device", device]) == code
    captured = capsys.readouterr()
    assert fragment in (captured.out if code == 0 else captured.err)


def test_conformance_compares_the_per_forward_trace(fixture_dir, tmp_path, capsys):
    def edit(cases):  # one traced forward of one case commits a different position
        step = next(t for t in cases[3]["trace"] if len(t["m2t"]) > 1)
        step["m2t"] = step["m2t"][:-1]

    assert main(["conformance", str(_fixture_copy(fixture_dir, tmp_path, edit)), "--kv", "on"]) == 1
    out = capsys.readouterr().out
    assert "first differs in m2t" in out and out.strip().endswith("1 failed")


def test_conformance_fails_on_an_expected_key_it_does_not_know(fixture_dir, tmp_path, capsys):
    def edit(cases):
        cases[0]["expected"]["tokens_per_joule"] = 3.0

    assert main(["conformance", str(_fixture_copy(fixture_dir, tmp_path, edit)), "--kv", "on"]) == 1
    assert "expected.tokens_per_joule: not a quantity this runner knows" in capsys.readouterr().out


def test_conformance_detects_a_wrong_model(fixture_dir, tmp_path, capsys):
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "fx"
    shutil.copytree(fixture_dir, broken)
    (broken / "model.safetensors").chmod(0o644)
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.layers.1.mlp.gate.expert_bias"] = torch.zeros_like(weights["model.layers.1.mlp.gate.expert_bias"])
    save_file(weights, str(broken / "model.safetensors"))
    assert main(["conformance", str(broken), "--kv", "on"]) == 1
    out = capsys.readouterr().out
    assert "FAIL logits block_causal" in out
    n_cases = len(json.loads((broken / "cases.json").read_text())["cases"])
    last = out.strip().splitlines()[-1]
    assert last.endswith("failed") and not last.endswith(" 0 failed")
    assert int(last.split()[0]) + int(last.split()[2]) == n_cases + 2


def test_mask_conformance_cases_pass_with_exact_counts(capsys):
    folder = Path(__file__).resolve().parents[1] / "conformance" / "llada2_mask"
    assert main(["conformance", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "20 decodes (10 cases x 2 KV modes): 48 expected values and 458 traced forwards compared" in out
    kinds = [c["exercises"][0] for c in json.loads((folder / "cases.json").read_text())["cases"]]
    assert {k: kinds.count(k) for k in set(kinds)} == {"exact": 4, "mask_decides": 3, "mask_drawn": 3}
