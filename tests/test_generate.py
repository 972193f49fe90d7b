"""Generation with stop strings: block segments give one decode's tokens and forwards exactly, and a
stop string ends a row's decoding (its later blocks cost nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlm_toolkit.config import ConfigError
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.evaluation.evaluate import load_checkpoint
from dlm_toolkit.evaluation.generate import cut_at_stop, generate, segmentable, validate_stops
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.tasks import get_task

TESTBED = Path(__file__).resolve().parents[1] / "checkpoints" / "testbed-v2-editable"


@pytest.fixture(scope="module")
def testbed():
    return load_checkpoint(TESTBED)


def prompts(tok, n=7):
    """Prompts of many lengths, so the batch's rows sit at different offsets inside a block."""
    insts = get_task("sort").instances(n, 3, "eval") + get_task("add").instances(n, 3, "eval")
    return [tok.encode(i.prompt, add_special_tokens=False) for i in insts]


@pytest.mark.parametrize("policy", [
    {"preset": "llada2.1-q", "blocks.params.block_length": 8},
    {"preset": "llada2.1-s", "blocks.params.block_length": 4},
    {"preset": "llada2.1-q", "blocks.params.block_length": 8, "blocks.params.align": "prompt"},  # decoded whole
    {"preset": "llada2.1-q", "blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 0,
     "blocks.params.block_length": 8},
])
def test_segments_give_one_decodes_tokens_and_forwards(testbed, policy):
    model, tok = testbed
    preset = policy.pop("preset")
    pol = DecodingPolicy(preset, **policy)
    ps = prompts(tok)
    seeds = [row_seed(1, i) for i in range(len(ps))]
    assert segmentable(model, pol) == (policy.get("blocks.params.align") != "prompt")
    whole = decode(model, ps, pol, 30, seed=seeds)
    for every in (1, 2):
        rows, _ = generate(model, tok, ps, pol, 30, stop=["@never@"], seeds=seeds, stop_every=every)
        for row, ref in zip(rows, whole.rows):
            assert (row.tokens, row.nfe, row.edits, row.remasks) == (ref.tokens, ref.nfe, ref.edits, ref.remasks)


def test_eos_ends_a_row_even_without_eos_early_stop(testbed):
    model, tok = testbed
    pol = DecodingPolicy("llada2.1-s", **{"blocks.params.block_length": 4, "blocks.params.eos_early_stop": False})
    ps = prompts(tok, 4)
    whole = decode(model, ps, pol, 60, seed=list(range(8)))
    rows, _ = generate(model, tok, ps, pol, 60, stop=["@never@"], seeds=list(range(8)))
    assert any(r.stopped == "eos" for r in rows)
    for row, ref in zip(rows, whole.rows):
        assert row.tokens == ref.tokens and row.nfe <= ref.nfe
        assert (row.nfe < ref.nfe) == (row.stopped == "eos" and row.blocks_skipped > 0)


def test_aligned_after_the_prompt_is_not_segmented(testbed):
    model, _ = testbed
    assert not segmentable(model, DecodingPolicy("llada2.1-q", **{"blocks.params.align": "prompt"}))


def test_a_stop_string_ends_the_row_and_saves_its_blocks(testbed):
    model, tok = testbed
    pol = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4})
    inst = get_task("sort").instances(1, 3, "eval")[0]
    ps = [tok.encode(inst.prompt, add_special_tokens=False), tok.encode("123+456=", add_special_tokens=False)]
    whole = decode(model, ps, pol, 50, seed=[0, 1])
    full_text = tok.decode(whole.rows[0].tokens)
    stop = full_text[12:15]  # something the row writes in its fourth block
    rows, _ = generate(model, tok, ps, pol, 50, stop=[stop], seeds=[0, 1])
    stopped, untouched = rows
    assert stopped.stopped == "stop" and stopped.text == full_text[: full_text.find(stop)]
    assert stopped.nfe < whole.rows[0].nfe and stopped.blocks_skipped > 0
    assert stopped.tokens == whole.rows[0].tokens[: len(stopped.tokens)]  # the same tokens up to where it stopped
    assert untouched.tokens == whole.rows[1].tokens and untouched.nfe == whole.rows[1].nfe


def test_unsegmentable_schedules_decode_whole_and_cut_the_text(testbed):
    model, tok = testbed
    pol = DecodingPolicy("llada2.1-q", **{"blocks.name": "multi_block_edit", "blocks.params.edit_blocks": 1,
                                           "blocks.params.block_length": 4})
    assert not segmentable(model, pol)
    ps = prompts(tok, 3)
    whole = decode(model, ps, pol, 24, seed=[5, 6, 7, 8, 9, 10])
    rows, _ = generate(model, tok, ps, pol, 24, stop=[","], seeds=[5, 6, 7, 8, 9, 10])
    for row, ref in zip(rows, whole.rows):
        assert row.tokens == ref.tokens and row.nfe == ref.nfe
        assert row.text == cut_at_stop(tok.decode([t for t in ref.tokens if t != model.eos_token_id]), [","])[0]


def test_cut_at_the_earliest_stop():
    assert cut_at_stop("a STOP b END", ["END", "STOP"]) == ("a ", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)


@pytest.mark.parametrize("stops, needle", [
    ([""], "empty stop string"),
    (["x" * 300], "300 characters"),
    (["a"] * 65, "more than 64"),
    ([3], "must be strings"),
])
def test_bad_stop_strings(stops, needle):
    with pytest.raises(ConfigError, match=needle):
        validate_stops(stops)
