"""Several devices: detect a ``torchrun`` launch, join its process group, and print once.

The launch line is the ordinary one::

    torchrun --nproc-per-node 4 --no-python -- dlm decode --checkpoint FLASH --device cuda ...

Every rank loads only its shard of the model (attention heads, dense/shared MLP slices, a range of
routed experts; see :class:`dlm_toolkit.models.llada2.TensorParallel`) and the layers all-reduce
their partial sums, so every rank ends each forward with the same logits, bit for bit.

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

from dlm_toolkit.config import ConfigError
from dlm_toolkit.models.llada2 import TensorParallel
from dlm_toolkit.runtime import resolve_device

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
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
        atexit.register(_shutdown)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    return TensorParallel(rank, world), dev


SHUTDOWN_WAIT_S = 30.0


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
