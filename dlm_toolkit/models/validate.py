"""Checks a checkpoint folder passes before anything is allocated: hostile input fails fast.

Every check reads only ``config.json``, the shard index and the safetensors *headers*, so an absurd
config (a vocabulary of 10^12, a million layers) fails in milliseconds naming the field, instead of
allocating or looping. Rules:

- ``config.json``, the shard index and the tokenizer files are regular files (a FIFO or a device
  is refused before it is opened for reading) of bounded size, JSON nested at most 64 levels;
  ``config.json`` is a JSON object; the model config validates (types, ranges, consistency) and
  the mask and EOS ids differ.
- Every file a checkpoint names (shards in the index, tokenizer files) resolves inside the folder
  after following symlinks; ``..``, absolute paths and links out are refused with their name.
- The index's ``weight_map`` maps tensor names (strings) to file names (strings).
- The headers agree with the config on every dimension that sizes the model before it is built:
  vocabulary and hidden size (embedding), layer count, expert count, attention heads, KV heads
  and ``head_dim`` (``query_key_value``, ``dense``, the q/k norms), the dense MLP width, the
  expert width and the shared experts. A config of 10^9-wide heads over a tiny checkpoint fails
  here, naming the fields, instead of in the allocator. (Every key and shape is compared after.)
- The parameters the config implies fit in the memory available for the weights (host memory,
  the cgroup's limit, or the GPU's free memory), stated in the message when they do not.
- Weights are float16, bfloat16 or float32 on disk; integer or bool tensors are refused by name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from dlm_toolkit.util.files import InputFileError, check_regular, parse_json, read_regular

FLOAT_DTYPES = {"F16", "BF16", "F32"}
MAX_JSON_BYTES = {"config": 1 << 20, "index": 64 << 20, "tokenizer": 256 << 20}
MAX_WEIGHTS_BYTES = 1 << 44  # 16 TiB: a size check would refuse nothing real; the file-kind check matters


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as-is (one error listing every problem)."""


def listing(title: str, items: list[str], limit: int = 10) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{title} ({len(items)}): " + ", ".join(items[:limit]) + more


def read_json_object(file: Path, kind: str = "config") -> dict[str, Any]:
    """The JSON object in ``file`` (``kind``: config, index or tokenizer, for the size limit).

    A FIFO, a device, a file over the limit, invalid or too deeply nested JSON, a list or a
    number is an error naming the file."""
    try:
        raw = parse_json(read_regular(file, MAX_JSON_BYTES[kind], f"a {kind} file"), str(file))
    except InputFileError as e:
        raise CheckpointError(str(e)) from None
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


def regular(file: Path, max_bytes: int, what: str) -> Path:
    """``file`` if it is a regular file of at most ``max_bytes`` (for files a library opens itself)."""
    try:
        check_regular(file, max_bytes, what)
    except InputFileError as e:
        raise CheckpointError(str(e)) from None
    return file


def index_files(folder: Path, index: Path) -> list[Path]:
    """The shard files an index names, each checked to lie inside ``folder``."""
    raw = read_json_object(index, "index")
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
    """Every dimension the config sizes the model by, against the headers, before the model is
    built (one error listing each disagreement with the fields it involves); then dtypes."""
    problems = []

    def expect(key: str, shape: tuple[int, ...], fields: str) -> None:
        found = stored.get(key)
        if found is not None and found[1] != shape:
            problems.append(f"{fields} imply {key} of shape {shape} but it is {found[1]}")

    c = config
    expect("model.word_embeddings.weight", (c.vocab_size, c.hidden_size),
           f"vocab_size={c.vocab_size}, hidden_size={c.hidden_size}")
    layers = {int(m.group(1)) for k in stored if (m := _LAYER.match(k))}
    if layers and max(layers) + 1 != c.num_hidden_layers:
        problems.append(f"num_hidden_layers={c.num_hidden_layers} but the weights hold {max(layers) + 1} layers")
    experts = {int(m.group(2)) for k in stored if (m := _EXPERT.match(k))}
    if experts and max(experts) + 1 != c.num_experts:
        problems.append(f"num_experts={c.num_experts} but the weights hold {max(experts) + 1} experts per layer")
    attn = "model.layers.0.attention"
    expect(f"{attn}.query_layernorm.weight", (c.head_dim,), f"head_dim={c.head_dim}")
    expect(f"{attn}.dense.weight", (c.hidden_size, c.num_attention_heads * c.head_dim),
           f"num_attention_heads={c.num_attention_heads}, head_dim={c.head_dim}")
    expect(f"{attn}.query_key_value.weight",
           ((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size),
           f"num_attention_heads={c.num_attention_heads}, num_key_value_heads={c.num_key_value_heads}, "
           f"head_dim={c.head_dim}")
    if c.first_k_dense_replace > 0:
        expect("model.layers.0.mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size),
               f"intermediate_size={c.intermediate_size}")
    if c.first_k_dense_replace < c.num_hidden_layers:
        moe = f"model.layers.{c.first_k_dense_replace}.mlp"
        expect(f"{moe}.experts.0.gate_proj.weight", (c.moe_intermediate_size, c.hidden_size),
               f"moe_intermediate_size={c.moe_intermediate_size}")
        shared = f"{moe}.shared_experts.gate_proj.weight"
        if c.num_shared_experts:
            expect(shared, (c.moe_intermediate_size * c.num_shared_experts, c.hidden_size),
                   f"moe_intermediate_size={c.moe_intermediate_size}, num_shared_experts={c.num_shared_experts}")
        elif shared in stored:
            problems.append(f"num_shared_experts=0 but the weights hold {shared}")
    if problems:
        raise CheckpointError(f"{folder / 'config.json'}: config does not match the weights: " + "; ".join(problems))
    not_float = [f"{k} ({dtype})" for k, (_, _, dtype) in sorted(stored.items()) if dtype not in FLOAT_DTYPES]
    if not_float:
        raise CheckpointError(f"{folder}: " + listing("weights that are not float16/bfloat16/float32", not_float))


def implied_parameters(config: Any) -> int:
    """Parameters the config implies (embedding, lm_head, every layer; router biases included)."""
    c = config
    H, hd = c.hidden_size, c.head_dim
    attention = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd * H + H * c.num_attention_heads * hd + 2 * hd
    dense = 3 * H * c.intermediate_size
    moe = (c.num_experts * H + c.num_experts + 3 * c.num_experts * H * c.moe_intermediate_size
           + 3 * H * c.moe_intermediate_size * c.num_shared_experts)
    layers = c.num_hidden_layers * (2 * H + attention) + c.first_k_dense_replace * dense \
        + (c.num_hidden_layers - c.first_k_dense_replace) * moe
    return 2 * c.vocab_size * H + H + layers


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free for weights on ``device`` and where that number comes from."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    found = [(_meminfo_available(), "MemAvailable of this machine")]
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap, used = Path(limit).read_text().strip(), int(Path(usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:
            found.append((int(cap) - used, "left under this cgroup's memory limit"))
    return min(found)


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_memory(folder: Path, config: Any, dtype: torch.dtype, device: torch.device, world: int = 1) -> None:
    """Refuse a model whose weights (as the config implies them, in ``dtype``, split over ``world``
    ranks) cannot fit in the memory available on ``device``: the message states both numbers."""
    params = implied_parameters(config)
    need = params * torch.tensor([], dtype=dtype).element_size() // max(world, 1)
    free, where = available_memory(device)
    if need > free:
        per = f" per rank ({world} ranks)" if world > 1 else ""
        raise CheckpointError(f"{folder / 'config.json'}: the config implies {params:,} parameters, "
                              f"{need / 1e9:.2f} GB{per} in {str(dtype).removeprefix('torch.')}, more than the "
                              f"{max(free, 0) / 1e9:.2f} GB {where}")


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
