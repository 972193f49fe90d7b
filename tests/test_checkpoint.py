"""Checkpoint loading/saving in the official safetensors layout, and its refusals."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm_toolkit.models import CheckpointError, load_model, save_model
from dlm_toolkit.models import checkpoint as ckpt

FIXTURE = Path(__file__).resolve().parents[1] / "conformance/llada2_tiny"
IDS = dict(mask_token_id=127, eos_token_id=126)
KEY = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def model():
    return load_model(FIXTURE, **IDS)


@pytest.fixture
def folder(tmp_path) -> Path:
    """A copy of the fixture checkpoint (config.json + model.safetensors) to break."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / name, dst / name)
    return dst


def listing(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def refused(path: Path, match: str, **kwargs) -> str:
    """Loading fails with a CheckpointError matching ``match`` and leaves the folder untouched."""
    before = listing(path)
    with pytest.raises(CheckpointError, match=match) as err:
        load_model(path, **(IDS | kwargs))
    assert listing(path) == before
    return str(err.value)


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def test_loaded_model_has_official_keys_and_no_meta_tensors(model):
    stored = load_file(FIXTURE / "model.safetensors")
    state = model.state_dict()
    assert state.keys() == stored.keys()
    assert all(not t.is_meta and torch.equal(t, stored[k]) for k, t in state.items())
    assert state["model.layers.1.mlp.gate.expert_bias"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_model_path_loads_the_same_weights(monkeypatch, dtype):
    """Checkpoints above SMALL_MODEL_NUMEL are built on the meta device; the result must not differ."""
    small = load_model(FIXTURE, dtype=dtype, **IDS)
    monkeypatch.setattr(ckpt, "SMALL_MODEL_NUMEL", 0)
    built_on_meta = []
    real_init = ckpt.LLaDA2MoeModelLM.__init__

    def spy(self, *args, **kwargs):
        built_on_meta.append(torch.empty(0).is_meta)  # the default device inside the constructor
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ckpt.LLaDA2MoeModelLM, "__init__", spy)
    large = load_model(FIXTURE, dtype=dtype, **IDS)
    assert built_on_meta == [True]
    assert same_weights(small, large)
    assert not any(t.is_meta for t in large.state_dict().values())


def test_round_trip_single_file(model, tmp_path):
    save_model(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    again = load_model(tmp_path / "out")  # special ids now come from config.json
    assert same_weights(model, again)
    assert (again.mask_token_id, again.eos_token_id) == (127, 126)
    saved = json.loads((tmp_path / "out/config.json").read_text())
    original = json.loads((FIXTURE / "config.json").read_text())
    assert set(saved) == set(original) | {"mask_token_id", "eos_token_id"}
    assert all(saved[k] == v for k, v in original.items())


def test_round_trip_sharded_with_index(model, tmp_path):
    out = tmp_path / "out"
    save_model(model, out)
    save_model(model, out, max_shard_bytes=200_000)  # replaces the single file
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert all((out / s).stat().st_size < 200_000 + 10_000 for s in shards)
    assert index["weight_map"].keys() == model.state_dict().keys()
    assert same_weights(model, load_model(out))


def test_round_trip_bfloat16(model, tmp_path):
    m16 = load_model(FIXTURE, dtype=torch.bfloat16, **IDS)
    save_model(m16, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16/config.json").read_text())["torch_dtype"] == "bfloat16"
    assert same_weights(m16, load_model(tmp_path / "bf16", dtype=torch.bfloat16))


def test_special_ids_from_tokenizer(folder):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(125)} | {"<eos>": 126, "<|mask|>": 127, "<unk>": 125}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    m = load_model(folder)
    assert (m.mask_token_id, m.eos_token_id) == (127, 126)
    assert load_model(folder, eos_token_id=5).eos_token_id == 5  # keyword wins


def test_missing_special_ids_is_an_error(folder):
    msg = refused(folder, "mask_token_id and eos_token_id", mask_token_id=None, eos_token_id=None)
    assert "keyword" in msg


def test_special_id_out_of_range(folder):
    refused(folder, "mask_token_id must be in \\[0, vocab_size=128\\), got 128", mask_token_id=128)


def test_missing_key(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors[KEY]
    save_file(tensors, folder / "model.safetensors")
    assert "missing keys (1): " + KEY in refused(folder, "missing")


def test_unexpected_keys_are_listed_and_truncated(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors |= {f"model.extra.{i}": torch.zeros(1) for i in range(12)}
    save_file(tensors, folder / "model.safetensors")
    msg = refused(folder, "unexpected keys \\(12\\)")
    assert "model.extra.0" in msg and "and 2 more" in msg


def test_wrong_shape(folder):
    tensors = load_file(folder / "model.safetensors")
    tensors[KEY] = torch.zeros(31, 64)
    save_file(tensors, folder / "model.safetensors")
    refused(folder, f"{KEY} expected \\(32, 64\\) found \\(31, 64\\)")


def test_truncated_file_names_the_file(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    refused(folder, "model.safetensors.*truncated or corrupt")


def test_broken_later_shard_fails_before_reading_data(model, tmp_path):
    out = tmp_path / "out"
    save_model(model, out, max_shard_bytes=200_000)
    last = sorted(out.glob("model-*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:1000])
    refused(out, last.name)


def test_pickle_only_folder_is_refused(tmp_path):
    shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    refused(tmp_path, "never unpickles.*safetensors")


def test_wrong_model_type(folder):
    config = json.loads((folder / "config.json").read_text()) | {"model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(config))
    refused(folder, "model_type must be 'llada2_moe', found 'llama'")


def test_invalid_config_value(folder):
    config = json.loads((folder / "config.json").read_text()) | {"topk_group": 9}
    (folder / "config.json").write_text(json.dumps(config))
    refused(folder, "config.json.*topk_group")


def test_failed_save_leaves_nothing_half_written(model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    save_model(model, out)
    before = listing(out)
    calls = []

    def failing_save_file(tensors, file, metadata=None):
        calls.append(file)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, file, metadata=metadata)

    monkeypatch.setattr(ckpt, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_model(model, out, max_shard_bytes=200_000)
    assert listing(out) == before  # old checkpoint intact, no temporaries, no stray shards


def test_saved_config_has_every_key_of_the_released_configs(tmp_path):
    """What we write loads in the reference code unchanged: every key of the (released-format)
    conformance config is present, with the same value where it applies."""
    released = json.loads((FIXTURE / "config.json").read_text())
    save_model(load_model(FIXTURE, mask_token_id=127, eos_token_id=126), tmp_path / "a")
    ours = json.loads((tmp_path / "a" / "config.json").read_text())
    assert set(released) <= set(ours), sorted(set(released) - set(ours))
    may_differ = {"transformers_version"}  # the writer's version
    assert {k: ours[k] for k in released if k not in may_differ} == {k: released[k] for k in released if k not in may_differ}
    # a model built from scratch (not read from a released config) writes the same fixed keys
    from dlm_toolkit.testing import tiny_llada2

    save_model(tiny_llada2(0), tmp_path / "b")
    fresh = json.loads((tmp_path / "b" / "config.json").read_text())
    assert set(released) <= set(fresh)
    assert fresh["pad_token_id"] == fresh["eos_token_id"] == 62 and fresh["use_bias"] is False
    assert fresh["rotary_dim"] == 4  # head_dim 8 x partial_rotary_factor 0.5
