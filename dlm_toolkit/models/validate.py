"""Checks a checkpoint folder passes before anything is allocated: hostile input fails fast.

Every check reads only ``config.json``, the shard index and the safetensors *headers*, so an absurd
config (a vocabulary of 10^12, a million layers) fails in milliseconds naming the field, instead of
allocating or looping. Rules:

- ``config.json`` is a JSON object; the model config validates (types, ranges, consistency) and
  the mask and EOS ids differ.
- Every file a checkpoint names (shards in the index, tokenizer files) resolves inside the folder
  after following symlinks; ``..``, absolute paths and links out are refused with their name.
- The index's ``weight_map`` maps tensor names (strings) to file names (strings).
- The headers agree with the config on what sizes the model before it is built: vocabulary and
  hidden size (embedding), layer count, expert count. (Every key and shape is compared after.)
- Weights are float16, bfloat16 or float32 on disk; integer or bool tensors are refused by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

FLOAT_DTYPES = {"F16", "BF16", "F32"}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as-is (one error listing every problem)."""


def listing(title: str, items: list[str], limit: int = 10) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{title} ({len(items)}): " + ", ".join(items[:limit]) + more


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file`` (a list, a number or invalid JSON is an error naming the file)."""
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: must hold a JSON object, found a {type(raw).__name__}")
    return raw


def inside(folder: Path, name: str, what: str) -> Path:
    """``folder / name`` if it resolves inside ``folder`` (symlinks followed), else an error."""
    base = folder.resolve()
    target = (folder / name).resolve()
    if not target.is_relative_to(base):
        raise CheckpointError(f"{folder}: {what} {name!r} resolves outside the checkpoint folder ({target})")
    return target


def index_files(folder: Path, index: Path) -> list[Path]:
    """The shard files an index names, each checked to lie inside ``folder``."""
    raw = read_json_object(index)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' must be an object of tensor name -> file name, "
                              f"found {type(weight_map).__name__}")
    bad = [f"{k!r}: {v!r}" for k, v in weight_map.items() if not isinstance(v, str) or not v]
    if bad:
        raise CheckpointError(f"{index}: " + listing("weight_map entries that are not file names", bad))
    return [inside(folder, name, "shard") for name in sorted(set(weight_map.values()))]


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def check_headers(folder: Path, config: Any, stored: dict[str, tuple[Path, tuple[int, ...], str]]) -> None:
    """Sizes the config implies against the headers, before the model is built; then dtypes."""
    problems = []
    emb = stored.get("model.word_embeddings.weight")
    if emb is not None and emb[1] != (config.vocab_size, config.hidden_size):
        problems.append(f"vocab_size={config.vocab_size}, hidden_size={config.hidden_size} but "
                        f"model.word_embeddings.weight is {emb[1]}")
    layers = {int(m.group(1)) for k in stored if (m := _LAYER.match(k))}
    if layers and max(layers) + 1 != config.num_hidden_layers:
        problems.append(f"num_hidden_layers={config.num_hidden_layers} but the weights hold {max(layers) + 1} layers")
    experts = {int(m.group(2)) for k in stored if (m := _EXPERT.match(k))}
    if experts and max(experts) + 1 != config.num_experts:
        problems.append(f"num_experts={config.num_experts} but the weights hold {max(experts) + 1} experts per layer")
    if problems:
        raise CheckpointError(f"{folder / 'config.json'}: config does not match the weights: " + "; ".join(problems))
    not_float = [f"{k} ({dtype})" for k, (_, _, dtype) in sorted(stored.items()) if dtype not in FLOAT_DTYPES]
    if not_float:
        raise CheckpointError(f"{folder}: " + listing("weights that are not float16/bfloat16/float32", not_float))


def check_special_ids(folder: Path, mask: int, eos: int, vocab_size: int) -> None:
    for name, v in (("mask_token_id", mask), ("eos_token_id", eos)):
        if not 0 <= v < vocab_size:
            raise CheckpointError(f"{folder}: {name} must be in [0, vocab_size={vocab_size}), got {v}")
    if mask == eos:
        raise CheckpointError(f"{folder}: mask_token_id and eos_token_id must differ, both are {mask}")


def non_finite(model: torch.nn.Module) -> list[str]:
    """Names of parameters and buffers holding NaN or infinity."""
    return [name for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_floating_point() and not torch.isfinite(t).all()]
