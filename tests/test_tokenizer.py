"""Character tokenizer: exact round trip, special ids, save/load."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dlm_toolkit.tasks import get_task
from dlm_toolkit.models.tokenizer import (
    EOS_TOKEN,
    MASK_TOKEN,
    build_char_tokenizer,
    load_tokenizer,
    save_tokenizer,
    special_ids,
)

ALPHABET = "".join(chr(c) for c in range(0x20, 0x7F)) + "\n"


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def test_vocab_layout(tok: PreTrainedTokenizerFast) -> None:
    assert len(tok) == 128
    assert tok.vocab_size == 128
    ids = [tok.convert_tokens_to_ids(ch) for ch in ALPHABET]
    assert len(set(ids)) == 96
    assert all(0 <= i < 128 for i in ids)
    assert tok.unk_token_id not in ids


def test_round_trip_random_printable(tok: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    samples = ["", " ", "  a  ", "\n\n", " . , ! ? 's n't ", "a\n b\n\n  c ", "<|mask", "|>"]
    for _ in range(300):
        samples.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 300))))
    for s in samples:
        ids = tok.encode(s)  # default add_special_tokens=True must add nothing
        assert len(ids) == len(s), s
        assert tok.decode(ids) == s
        assert tok(s)["input_ids"] == ids


def test_batch_decode_round_trip(tok: PreTrainedTokenizerFast) -> None:
    texts = [" x = 1\n", "y  ", "\n"]
    batch = tok(texts)["input_ids"]
    assert tok.batch_decode(batch) == texts


def test_task_strings_round_trip(tok: PreTrainedTokenizerFast) -> None:
    for name in ("add", "sort", "sudoku"):
        for inst in get_task(name).instances(20, seed=1, split="train"):
            for s in (inst.prompt, inst.reference, inst.prompt + inst.reference):
                ids = tok.encode(s)
                assert len(ids) == len(s) and tok.decode(ids) == s
    inst = get_task("humaneval").instances(5, seed=0, split="eval")[0]
    assert tok.decode(tok.encode(inst.prompt + inst.reference)) == inst.prompt + inst.reference


def test_special_ids(tok: PreTrainedTokenizerFast) -> None:
    mask_id, eos_id = special_ids(tok)
    assert mask_id != eos_id
    assert tok.convert_ids_to_tokens([mask_id, eos_id]) == [MASK_TOKEN, EOS_TOKEN]
    assert tok.pad_token_id == eos_id
    assert tok.bos_token is None
    # special tokens in text map to a single id; characters never do
    assert tok.encode("a" + MASK_TOKEN + "b") == [
        tok.convert_tokens_to_ids("a"),
        mask_id,
        tok.convert_tokens_to_ids("b"),
    ]
    assert tok.decode([mask_id, eos_id]) == MASK_TOKEN + EOS_TOKEN
    assert tok.decode(tok.encode("ab") + [eos_id, eos_id], skip_special_tokens=True) == "ab"


def test_unknown_character_maps_to_unk(tok: PreTrainedTokenizerFast) -> None:
    ids = tok.encode("a\u279eb\t")
    assert ids[1] == tok.unk_token_id and ids[3] == tok.unk_token_id
    assert len(ids) == 4


def test_save_load(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    out = save_tokenizer(tok, tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file()
    text = "sort:45,12=12,45\n  x "
    for loaded in (
        load_tokenizer(out),
        AutoTokenizer.from_pretrained(str(out)),
        PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")),
    ):
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
        assert special_ids(loaded) == special_ids(tok)
        assert len(loaded) == 128


def test_load_error_on_empty_or_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
