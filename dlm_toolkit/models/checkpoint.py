"""Load and save LLaDA2 MoE checkpoints in the official Hugging Face layout, safetensors only.

A checkpoint folder holds ``config.json`` (``model_type: llada2_moe``) and either
``model.safetensors`` or ``model.safetensors.index.json`` plus its shards. Pickled weights
(``pytorch_model.bin``) are refused: we never unpickle and never run remote code.

Memory: the model is built on the ``meta`` device (no random init, no storage), every key and
shape is checked against the safetensors headers before any tensor data is read, and tensors are
then read one at a time and assigned into the module. Peak RAM is therefore about one model copy
plus one tensor. For the released models (their released configs, router weights kept in float32):

* LLaDA2 mini: 16.26B parameters (1.43B active per token) -> ~32.5 GB in bfloat16, one GPU.
* LLaDA2 flash: 102.9B parameters (6.15B active) -> ~206 GB in bfloat16: several GPUs. Pass
  ``tp=TensorParallel(rank, world)`` (what ``dlm_toolkit.models.distributed.init_from_env`` returns under
  ``torchrun``) and each rank builds only its shard and reads only its slices of each tensor
  (safetensors ``get_slice``), so its peak memory is about its shard (table in benchmarks/README.md).

Routed experts are stored stacked in the model; the per-expert checkpoint keys are views into the
stacks (``state_dict()``), so reading a key writes straight into its expert's slot.

Saving holds one shard's bytes in addition to the model (pass ``max_shard_bytes`` to bound it).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dlm_toolkit.util.files import atomic_write_many
from dlm_toolkit.util.runtime import SMALL_MODEL_NUMEL  # defined in util: is_small reads it without importing models

from .llada2 import LLaDA2Config, LLaDA2MoeModelLM, TensorParallel
from .validate import (MAX_JSON_BYTES, MAX_WEIGHTS_BYTES, CheckpointError, check_headers, check_memory, check_special_ids,
                       index_files, inside, listing, non_finite, read_json_object, regular)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MASK_TOKEN = "<|mask|>"
DEFAULT_EOS_TOKEN = "<|endoftext|>"


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise CheckpointError(f"{file}: not found (a checkpoint folder needs config.json)")
    raw = read_json_object(inside(path, "config.json", "config"))
    if raw.get("model_type") != "llada2_moe":
        raise CheckpointError(f"{file}: model_type must be 'llada2_moe', found {raw.get('model_type')!r}")
    return raw


def _tokenizer_ids(path: Path) -> tuple[int | None, int | None]:
    """Mask and EOS ids from tokenizer.json (EOS token named by tokenizer_config.json if present)."""
    if not (path / "tokenizer.json").is_file():
        return None, None
    from tokenizers import Tokenizer

    file = regular(inside(path, "tokenizer.json", "tokenizer file"), MAX_JSON_BYTES["tokenizer"], "a tokenizer file")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises plain Exception for a corrupt file
        raise CheckpointError(f"{file}: not a readable tokenizer ({e})") from None
    eos = DEFAULT_EOS_TOKEN
    if (path / "tokenizer_config.json").is_file():
        named = read_json_object(inside(path, "tokenizer_config.json", "tokenizer file"), "tokenizer").get("eos_token") or eos
        eos = named.get("content") if isinstance(named, dict) else named  # the added-token form: {"content": ...}
        if not isinstance(eos, str):
            raise CheckpointError(f"{path / 'tokenizer_config.json'}: eos_token must be a token's text or "
                                  f"{{\"content\": text}} (got {named!r:.80})")
    return tok.token_to_id(MASK_TOKEN), tok.token_to_id(eos)


def _special_ids(path: Path, config: LLaDA2Config, mask_token_id: int | None, eos_token_id: int | None
                 ) -> tuple[int, int]:
    """Keyword arguments first, then config.json, then the tokenizer in the folder."""
    mask = mask_token_id if mask_token_id is not None else config.mask_token_id
    eos = eos_token_id if eos_token_id is not None else config.eos_token_id
    if mask is None or eos is None:
        tok_mask, tok_eos = _tokenizer_ids(path)
        mask = tok_mask if mask is None else mask
        eos = tok_eos if eos is None else eos
    missing = [name for name, v in (("mask_token_id", mask), ("eos_token_id", eos)) if v is None]
    if missing:
        raise CheckpointError(
            f"{path}: cannot determine {' and '.join(missing)}: not passed as keyword arguments, not in "
            f"config.json, and no tokenizer.json defining {MASK_TOKEN!r} / the EOS token. "
            f"Pass load_model(..., mask_token_id=..., eos_token_id=...)."
        )
    check_special_ids(path, mask, eos, config.vocab_size)
    return mask, eos


def _weight_files(path: Path) -> list[Path]:
    if (path / SINGLE).exists():
        return [regular(inside(path, SINGLE, "weights file"), MAX_WEIGHTS_BYTES, "a weights file")]
    if (path / INDEX).exists():
        files = index_files(path, inside(path, INDEX, "shard index"))
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{path / INDEX}: " + listing("shards listed but not found", absent))
        return [regular(f, MAX_WEIGHTS_BYTES, "a weights file") for f in files]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")) or list(path.glob("*.pth")):
        raise CheckpointError(
            f"{path}: only pickled PyTorch weights found. dlm-toolkit never unpickles checkpoints; convert "
            f"them to safetensors (e.g. with a trusted tool on a trusted machine) and save as {SINGLE} or "
            f"sharded with {INDEX}."
        )
    raise CheckpointError(f"{path}: no {SINGLE} or {INDEX} found")


def _read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """key -> (file, shape, dtype) from the safetensors headers only (no tensor data is read)."""
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    duplicated = []
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in found:
                        duplicated.append(f"{key} ({found[key][0].name} and {file.name})")
                    piece = f.get_slice(key)
                    found[key] = (file, tuple(piece.get_shape()), piece.get_dtype())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: not a readable safetensors file (truncated or corrupt?): {e}") from e
    if duplicated:
        raise CheckpointError(listing("keys stored in more than one shard", duplicated))
    return found


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               mask_token_id: int | None = None, eos_token_id: int | None = None,
               tp: TensorParallel | None = None, check_finite: bool = False) -> LLaDA2MoeModelLM:
    """Load an official-format LLaDA2 MoE checkpoint folder into a :class:`LLaDA2MoeModelLM`.

    Weights are converted to ``dtype`` (the router stays float32) and placed on ``device``.
    Special ids come from the keyword arguments, else config.json, else the folder's tokenizer.
    ``tp``: load only this rank's shard of a tensor/expert-parallel model (every rank checks the
    whole checkpoint's keys and shapes, then reads only its own slices).
    ``check_finite``: scan the loaded weights for NaN/inf (one pass over the model).
    Raises :class:`CheckpointError` for any problem with the folder, before reading tensor data
    (see :mod:`dlm_toolkit.models.validate` for what is checked before anything is allocated).
    """
    tp = tp or TensorParallel()
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    raw = _read_config(path)
    try:
        config = LLaDA2Config(**raw)
    except ValidationError as e:
        details = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise CheckpointError(f"{path / 'config.json'}: invalid config: {details}") from e
    mask, eos = _special_ids(path, config, mask_token_id, eos_token_id)
    stored = _read_headers(_weight_files(path))
    check_headers(path, config, stored)
    check_memory(path, config, dtype, torch.device(device), tp.world)

    # A large model is built on the meta device (no allocation, no init) and filled from the
    # file. A small one is built in place: its init costs milliseconds, while the first meta
    # tensor of a process imports torch._dynamo (~0.8 s), which every sweep worker would pay.
    numel = sum(math.prod(shape) for _, shape, _ in stored.values())
    on_meta = numel > SMALL_MODEL_NUMEL
    with torch.device("meta" if on_meta else device):
        model = LLaDA2MoeModelLM(config, dtype=dtype, mask_token_id=mask, eos_token_id=eos, tp=tp)
    if tp.world > 1:  # the checkpoint is checked against the whole model's names and shapes
        with torch.device("meta"):
            expected = LLaDA2MoeModelLM(config, dtype=dtype, mask_token_id=mask, eos_token_id=eos).state_dict()
    else:
        expected = model.state_dict()
    missing = [k for k in expected if k not in stored]
    unexpected = [k for k in stored if k not in expected]
    wrong = [f"{k} expected {tuple(t.shape)} found {stored[k][1]} ({stored[k][0].name})"
             for k, t in expected.items() if k in stored and tuple(t.shape) != stored[k][1]]
    problems = [listing(title, items) for title, items in
                (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", wrong)) if items]
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match the config: " + "; ".join(problems))

    if on_meta:
        model.to_empty(device=device)
    local = model.state_dict()  # views of the parameters (per-expert keys: slots of the stacks)
    by_file: dict[Path, list[str]] = {}
    for key, (file, _, _) in stored.items():
        if key in local:
            by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for key in keys:
                pieces = [f.get_slice(key)[index] if index else f.get_tensor(key)
                          for index in model.checkpoint_slices(key)]
                local[key].copy_(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
    if check_finite:
        bad = non_finite(model)
        if bad:
            raise CheckpointError(f"{path}: " + listing("weights holding NaN or infinity", bad))
    return model


def save_model(model: LLaDA2MoeModelLM, path: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (one ``model.safetensors``, or shards of at most
    ``max_shard_bytes`` plus ``model.safetensors.index.json``) under the official names.

    The config keeps every key it was read with and adds ``mask_token_id``/``eos_token_id``.
    Every file goes to a temporary name first and all are renamed into place once complete
    (:func:`dlm_toolkit.util.files.atomic_write_many`): a kill or a full disk leaves the previous
    checkpoint as it was (a full disk raises :class:`~dlm_toolkit.util.files.NoSpaceError`). Stale
    weight files of the other layout in ``path`` are removed after the new ones are in place.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if model.tp.world > 1:
        raise ValueError("save_model: this model is one rank's shard of a tensor-parallel model; save a "
                         "single-process model instead")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}

    config = model.config.to_hf_dict()
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    for name in ("mask_token_id", "eos_token_id"):
        if getattr(model, name) >= 0:
            config[name] = getattr(model, name)
    if model.eos_token_id >= 0:
        config.setdefault("pad_token_id", model.eos_token_id)  # the reference's padding index

    def writer(tensors: dict):
        return lambda file: save_file(tensors, file, metadata={"format": "pt"})

    files = {"config.json": lambda file: file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")}
    if max_shard_bytes is None:
        files[SINGLE] = writer(state)
    else:
        shards: list[dict] = [{}]
        size = 0
        for key, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = t
            size += nbytes
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
        files.update({name: writer(shard) for name, shard in zip(names, shards)})
        files[INDEX] = lambda file: file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    atomic_write_many(path, files)
    remove_stale_weights(path, keep=set(files))


def remove_stale_weights(path: Path, keep: set[str]) -> None:
    """Remove weight files of ``path`` not in ``keep`` (the other layout's, after a new save)."""
    for stale in [path / SINGLE, path / INDEX, *path.glob("model-*-of-*.safetensors")]:
        if stale.name not in keep and stale.exists():
            stale.unlink()
