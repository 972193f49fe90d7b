"""Where and how to run: device, dtype and CPU threads, said the same way everywhere.

The CLI (``--device/--dtype/--threads``), experiment YAMLs (``device:``, ``dtype:``,
``threads:``) and the Python API (``load_checkpoint(..., device=, dtype=)``,
``evaluate(..., threads=)``) all resolve through :func:`resolve_device`, :func:`resolve_dtype`
and :func:`resolve_threads`, so a bad value gets the same one-line error from each.

Defaults: the CPU in float32; on a CUDA device bfloat16 (the released LLaDA2 weights' dtype; the
router, the softmax and the confidences stay float32 whatever the weights are). Threads: one per
process for small CPU models (tiny models decode fastest on one thread, and on a busy machine two
threads can be 50x slower), torch's own default for large ones.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch

from dlm_toolkit.util.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or a :class:`torch.device`) checked against this
    machine; ``None`` means the CPU. Raises :class:`ConfigError` naming the value and what exists."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"device: {device!r} is not a device (use cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible GPU"
            raise ConfigError(f"device: {device!r} asked for CUDA, but this machine has none ({build}, torch "
                              f"{torch.__version__}); use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device: {device!r} does not exist: this machine has {count} CUDA device(s), "
                              f"cuda:0..cuda:{count - 1}")
        return dev
    raise ConfigError(f"device: {device!r} is not supported (use cpu, cuda or cuda:N)")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A weight dtype by name (``float32``/``bfloat16``/``float16`` or fp32/bf16/fp16); ``None``
    means float32 on the CPU and bfloat16 on a GPU."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ConfigError(f"dtype: {dtype} is not a weight dtype (allowed: float32, bfloat16, float16)")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
    return DTYPES[dtype]


@lru_cache(maxsize=1)
def host_memory_bytes() -> int:
    """This machine's memory as this process may use it: the physical memory, or the memory limit
    of the cgroup the process runs in where that is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            total = min(total, int(Path(limit).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max"
            pass
    return total


def cpu_count() -> int:
    """CPUs of this machine (``os.cpu_count()``; 1 if unknown): the most threads worth asking for."""
    return os.cpu_count() or 1


def resolve_threads(threads: int | None, *, small_model: bool) -> int | None:
    """The intra-op thread count to use: ``threads`` if given (an integer from 1 to the machine's
    CPU count: more only oversubscribes, and a million makes the tokenizer's thread pool panic and
    the process crash), else 1 for a small model and ``None`` (torch's default) for a large one."""
    if threads is None:
        return 1 if small_model else None
    most = cpu_count()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= most:
        raise ConfigError(f"threads: must be an integer in [1, {most}] (this machine has {most} CPUs), "
                          f"got {threads!r}")
    return threads


def apply_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` unless ``None``."""
    if threads is not None:
        torch.set_num_threads(threads)


@contextmanager
def threads_scope(threads: int | None) -> Iterator[None]:
    """Run a block with ``threads`` intra-op threads (``None``: unchanged), restoring them after."""
    before = torch.get_num_threads()
    apply_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# parameters up to which a model is small: load_model builds it in place (not on the meta device), and
# is_small says so (here, below the models that use it: util imports no model)
SMALL_MODEL_NUMEL = 1 << 24


def is_small(model: object) -> bool:
    """A model of at most ``SMALL_MODEL_NUMEL`` parameters (scripted models without any are small)."""
    parameters = getattr(model, "parameters", None)
    return (sum(p.numel() for p in parameters()) if callable(parameters) else 0) <= SMALL_MODEL_NUMEL
