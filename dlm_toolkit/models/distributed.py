"""Several devices: detect a ``torchrun`` launch, join its process group, and print once.

The launch line is the ordinary one::

    torchrun --nproc-per-node 4 --no-python -- dlm decode --checkpoint FLASH --device cuda ...

Every rank loads only its shard of the model (attention heads, dense/shared MLP slices, a range of
routed experts; see :class:`dlm_toolkit.models.llada2.TensorParallel`) and the layers all-reduce
their partial sums, so every rank ends each forward with the same logits, bit for bit.

Before any weight is read the ranks agree (:func:`agree`): each puts the fields that must match
(:func:`run_fields`: the software versions, every command-line argument, and a digest of every file
or folder an argument names -- prompts, policy and data files, the checkpoint's config, tokenizer
and shards) into the process group's store; a difference, or a rank that has not reported within
``DLM_AGREE_WAIT_S`` (120 s), stops every rank with the same one line naming the rank and the
field. Without it a rank given another seed, prompt or checkpoint decodes garbage or waits forever
in a collective the others never enter.

Who owns the decode state: nobody in particular. Every rank runs ``decode()`` on the same prompts
with the same seeds, so the same logits give the same sampled tokens, the same rule decisions and
the same host-side control flow on every rank; ranks never exchange decode state, and a policy or
plug-in needs no change. (A rule that read anything rank-dependent, such as wall-clock time, could
let ranks diverge; no built-in does.) Output goes through rank 0: the other ranks' ``stdout`` is
silenced, their ``stderr`` is kept so that a rank-specific failure is seen.
"""

from __future__ import annotations

import atexit
import os
import sys
from datetime import timedelta

import torch

from dlm_toolkit.util.errors import ConfigError
from dlm_toolkit.models.llada2 import TensorParallel
from dlm_toolkit.util.runtime import resolve_device

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"{name}: not set; a torchrun launch sets RANK, WORLD_SIZE, LOCAL_RANK, "
                              "MASTER_ADDR and MASTER_PORT")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be an integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError(f"{name}: must be >= 0, got {value}")
    return value


def launched() -> bool:
    """Whether this process is one rank of a multi-process launch (``WORLD_SIZE`` > 1)."""
    return _env_int("WORLD_SIZE", 1) > 1


def init_from_env(device: str | torch.device | None = None) -> tuple[TensorParallel, torch.device]:
    """``(tp, device)`` for this process.

    Outside a multi-process launch: the single-device :class:`TensorParallel` and
    ``resolve_device(device)``. Under ``torchrun`` (``WORLD_SIZE`` > 1): joins the default process
    group (NCCL for ``cuda``, gloo for ``cpu``; once per process), uses ``cuda:LOCAL_RANK`` as the
    device, silences ``stdout`` on ranks other than 0, and returns ``TensorParallel(RANK,
    WORLD_SIZE)``. Bad settings raise :class:`ConfigError` (one line, exit 2 from the CLI).
    """
    dev = resolve_device(device)
    if not launched():
        return TensorParallel(), dev
    import torch.distributed as dist

    rank, world, local = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    if rank >= world:
        raise ConfigError(f"RANK: must be in [0, WORLD_SIZE={world}), got {rank}")
    if dev.type == "cuda":
        if dev.index is not None:
            raise ConfigError(f"device: {device!r} under torchrun: pass --device cuda; each rank uses "
                              "cuda:LOCAL_RANK")
        count = torch.cuda.device_count()
        if local >= count:
            raise ConfigError(f"LOCAL_RANK: {local} but this machine has {count} CUDA device(s); start at most "
                              f"{count} processes per node")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        wait_s = agree_wait_s()
        # a rank that never joins stops the others after wait_s, not after the 30 min default
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=wait_s))
        atexit.register(_shutdown)
        agree(rank, world, run_fields(sys.argv), wait_s)  # before any weight is read: every rank runs the same job
        try:  # collectives: a rank may be minutes late (loading its shard), as before
            dist.distributed_c10d._set_pg_timeout(dist.distributed_c10d.default_pg_timeout)
        except (AttributeError, ValueError, AssertionError, RuntimeError):
            pass
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    return TensorParallel(rank, world), dev


SHUTDOWN_WAIT_S = 30.0
AGREE_WAIT_S = 120.0  # how long a rank waits for the others' fields (DLM_AGREE_WAIT_S overrides)
SMALL_FILE = 2 << 20  # files up to this size are hashed whole; larger ones by header, size and samples
SAMPLES = 16
MAX_FOLDER_FILES = 256


def file_digest(path: str) -> str:
    """A digest of one file's content: whole for small files; for weight shards (hundreds of GB
    on a real checkpoint) the size, the first MiB (the safetensors header), the last 64 KiB and
    :data:`SAMPLES` evenly spread 64 KiB pieces -- cheap, and two different trainings or dtypes
    never agree on it."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(str(size).encode())
            if size <= SMALL_FILE:
                h.update(f.read(SMALL_FILE + 1))
            else:
                for offset in [0, *(size * k // (SAMPLES + 1) for k in range(1, SAMPLES + 1)), size - (64 << 10)]:
                    f.seek(offset)
                    h.update(f.read((1 << 20) if offset == 0 else (64 << 10)))
    except OSError as err:
        return f"unreadable ({err.strerror})"
    return h.hexdigest()[:16]


def path_digest(path: str) -> str:
    """What a command-line path names on this rank: a file's :func:`file_digest`, a folder's files
    (names and digests, one level), or ``missing``."""
    import stat

    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    if stat.S_ISREG(st.st_mode):
        return file_digest(path)
    if not stat.S_ISDIR(st.st_mode):
        return "not a regular file or folder"
    try:
        names = sorted(os.listdir(path))[:MAX_FOLDER_FILES]
    except OSError as err:
        return f"unreadable ({err.strerror})"
    parts = [f"{n}={file_digest(os.path.join(path, n))}" for n in names if os.path.isfile(os.path.join(path, n))]
    import hashlib

    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def run_fields(argv: list[str]) -> dict[str, str]:
    """Everything that must be equal on every rank, by name: the software, each command-line
    argument (named by its option), and the content of every file or folder an argument names
    (prompts, policy and data files, the checkpoint's config, tokenizer and weight shards)."""
    import dlm_toolkit

    fields = {"software": f"dlm-toolkit {dlm_toolkit.__version__}, torch {torch.__version__}",
              "arguments": str(len(argv) - 1)}
    option = ""
    for i, token in enumerate(argv[1:], start=1):
        name, value = token, token
        if token.startswith("--") and "=" in token:
            name, value = token.split("=", 1)
        elif token.startswith("-") and len(token) > 1 and not _number(token):
            option = token
            fields[f"argument {i} ({token})"] = token
            continue
        where = f"argument {i} ({name if name != value else option or 'positional'})"
        fields[where] = value
        if value and len(value) < 4096 and os.path.lexists(value) or _looks_like_path(value):
            fields[f"{where} content of {value}"] = path_digest(value)
        option = ""
    return fields


def _number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _looks_like_path(value: str) -> bool:
    """A value that names a path on some rank may be missing on another: compare it as a path."""
    return len(value) < 4096 and ("/" in value or value.endswith((".json", ".yaml", ".yml", ".jsonl", ".txt")))


def agree_wait_s() -> float:
    """``DLM_AGREE_WAIT_S`` (seconds, > 0), else :data:`AGREE_WAIT_S`."""
    raw = os.environ.get("DLM_AGREE_WAIT_S")
    if raw is None:
        return AGREE_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise ConfigError(f"DLM_AGREE_WAIT_S: must be a number of seconds in (0, 86400], got {raw!r}")
    return value


def agree(rank: int, world: int, fields: dict[str, str], wait_s: float | None = None) -> None:
    """Exchange ``fields`` through the process group's store; every rank stops with the same one
    line if any rank differs, or if a rank does not report within ``wait_s`` seconds.

    Raises:
        ConfigError: ``ranks disagree on FIELD: rank 0 has A, rank R has B ...`` or ``rank R did
            not start ...``.
    """
    import json

    import torch.distributed as dist

    wait_s = agree_wait_s() if wait_s is None else wait_s
    store = dist.distributed_c10d._get_default_store()
    keys = [f"dlm_toolkit/agree/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(fields, sort_keys=True))
    try:
        store.wait(keys, timedelta(seconds=wait_s))
    except Exception:  # noqa: BLE001 - the store's timeout error type differs between torch versions
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise ConfigError(f"rank {', '.join(map(str, missing)) or '?'} did not start within {wait_s:.0f} s "
                          "(it failed before joining, or DLM_AGREE_WAIT_S is too short for it); every rank stops")
    table = [json.loads(store.get(key)) for key in keys]
    for r, theirs in enumerate(table):
        for name in [*table[0], *(n for n in theirs if n not in table[0])]:  # in command-line order
            # a value that names nothing on one rank has no content field there: it is missing
            absent = "missing" if " content of " in name else None
            mine, other = table[0].get(name, absent), theirs.get(name, absent)
            if mine != other:
                raise ConfigError(f"ranks disagree on {name}: rank 0 has {_show(mine)}, rank {r} has "
                                  f"{_show(other)}; every rank must run the same command on the same files")


def _show(value: str | None) -> str:
    if value is None:
        return "nothing"
    return repr(value if len(value) <= 80 else value[:77] + "...")


def _shutdown() -> None:
    """Leave together, then destroy the process group. A rank that closes its connections while a
    peer is still finishing can get the peer aborted by gloo's threads ("terminate called without
    an active exception", seen once under load); a peer that never arrives (it crashed) delays
    this rank's exit by at most ``SHUTDOWN_WAIT_S``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    try:
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=SHUTDOWN_WAIT_S))
    except Exception:  # noqa: BLE001 - a peer is gone or late: nothing left to wait for
        pass
    dist.destroy_process_group()


def is_main_process() -> bool:
    """True on rank 0 of a launch and in an ordinary single process: the one that prints and
    writes results (tracking runs, files)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return _env_int("RANK", 0) == 0
