"""How far a model forward is from the weight-read bound, and what it costs per forward.

A decode forward at small batch reads every weight it uses once and does little arithmetic per
byte, so its time is bounded below by ``bytes it must read / the memory's copy rate``. The bytes
come from the routing the forward actually did: every weight of the model except the routed
experts and the embedding table, plus, per MoE layer, the experts at least one token was sent to,
plus one embedding row per token. The copy rate is measured with a large device-to-device copy
(read + write bytes over time).

Used by ``full_scale.py`` (the ``bound_*`` and ``*_graphs`` fields of its records); the functions
take any :class:`~dlm_toolkit.models.LLaDA2MoeModelLM`, sharded or not (a rank reads its own part).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dlm_toolkit.models.llada2 import LLaDA2MoeModelLM, MoE


def experts_hit(model: LLaDA2MoeModelLM, forward: Callable[[], Any]) -> list[int]:
    """Per MoE layer, how many of this rank's routed experts received at least one token during
    ``forward()`` (one eager forward; the count reads the routing back, so it is not timed)."""
    layers = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    hit: list[torch.Tensor] = [torch.zeros(m.experts.count, dtype=torch.bool, device=model.lm_head.weight.device)
                               for m in layers]
    handles = []
    for i, moe in enumerate(layers):
        def record(module: Any, inputs: Any, output: Any, i: int = i, moe: MoE = moe) -> None:
            slot = output[1].flatten() - moe.experts.first
            mine = slot[(slot >= 0) & (slot < moe.experts.count)]
            hit[i][mine] = True
        handles.append(moe.gate.register_forward_hook(record))
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    return [int(h.sum()) for h in hit]


def weight_bytes(model: LLaDA2MoeModelLM, hit: list[int], tokens: int) -> dict[str, int]:
    """Bytes one forward must read: ``dense`` (every parameter and buffer except the routed
    experts and the embedding table: attention, norms, dense MLPs, routers, shared experts,
    lm_head), ``experts`` (the ``hit[i]`` experts of MoE layer ``i``, all three projections) and
    ``embedding`` (one row per token); ``total`` their sum."""
    moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    if len(hit) != len(moes):
        raise ValueError(f"hit: one count per MoE layer ({len(moes)}), got {len(hit)}")
    table = model.model.word_embeddings.weight
    routed = {id(p) for m in moes for p in m.experts.parameters()}
    tensors = [*model.parameters(), *model.buffers()]
    dense = sum(t.numel() * t.element_size() for t in tensors if id(t) not in routed and t is not table)
    per_expert = [sum(p[0].numel() * p.element_size() for p in (m.experts.gate_proj, m.experts.up_proj,
                                                                 m.experts.down_proj)) for m in moes]
    experts = sum(n * b for n, b in zip(hit, per_expert, strict=True))
    embedding = tokens * table.shape[1] * table.element_size()
    return {"dense": dense, "experts": experts, "embedding": embedding, "total": dense + experts + embedding}


def copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of ``repeats``; 1 GiB
    on a GPU, 64 MiB on a CPU by default."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**26)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up (page faults, clocks)
        seconds = _timed(lambda: dst.copy_(src), device, 1)
        best = min(best, seconds)
    return copy_rate(src.numel() * 4, best)


def copy_rate(nbytes: int, seconds: float) -> float:
    """Bytes per second of a copy of ``nbytes`` that took ``seconds``: it reads and writes each byte."""
    return 2 * nbytes / seconds


def _timed(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` over ``iters`` back-to-back calls (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def forward_stats(fn: Callable[[], Any], device: torch.device, iters: int = 10) -> dict[str, float | None]:
    """``ms_per_forward`` of ``fn()`` (after two warm-up calls), ``aten_ops_per_forward`` (outermost
    aten ops) and, on a
    GPU, ``kernels_per_forward`` and ``gpu_busy_fraction`` (kernel time per forward, from
    ``torch.profiler``, over the unprofiled time per forward)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    seconds = _timed(fn, device, iters)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiled = max(1, iters // 2)
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    events = prof.events()
    # ops the model issues: aten ops not called from inside another aten op (aten::linear, not the
    # aten::matmul and aten::mm under it)
    aten = sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))
    out: dict[str, float | None] = {"ms_per_forward": 1e3 * seconds, "aten_ops_per_forward": aten / profiled,
                                    "kernels_per_forward": None, "gpu_busy_fraction": None}
    if cuda:  # busy: kernel time per forward over the unprofiled time per forward
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 1e6 / profiled  # device_time is in microseconds
        out["kernels_per_forward"] = len(kernels) / profiled
        out["gpu_busy_fraction"] = min(1.0, busy / seconds)
    return out
