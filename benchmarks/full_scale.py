"""Full-scale decode benchmark: random weights in the exact LLaDA2.1 mini / flash shapes, bf16.

One GPU (mini)::

    python benchmarks/full_scale.py --shape mini --json

Several GPUs (flash, tensor + expert parallel; each rank builds only its shard)::

    torchrun --nproc-per-node 4 benchmarks/full_scale.py --shape flash --json

On a CPU (or with ``--cpu-smoke``) a scaled-down shape of the same architecture runs in seconds,
also under ``torchrun`` with gloo ranks, so CI runs the script end to end. For every batch size
(1, 8) and preset (Q, S) it decodes a fixed prompt set with block length 32 and prints one record:
tokens/s, ms per forward, NFE, TPF, engine overhead fraction, peak memory and the device name.
``--roundtrip DIR`` then saves the random model in the official checkpoint format (safetensors
shards + index), loads it back with ``load_model`` onto the device and checks that it decodes the
same tokens (``--layers`` keeps the first N layers, so the round trip at real shapes fits a disk).
``--memory-table`` prints the bf16 memory per rank of mini and flash at 1/2/4/8 ranks (from the
shapes: the model is built on the meta device, nothing is allocated).

Timing: forwards are timed with CUDA events on a GPU (the engine's own ``model_time`` only sees
the asynchronous launch there) and with the host clock on a CPU. Random weights do not make a
trained model's confidences, so NFE/TPF here say little about quality; the lm_head is scaled
(``--logit-scale``) so that confidences spread and both commit paths (threshold and fallback) run.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bound import copy_bandwidth, experts_hit, forward_stats, weight_bytes  # noqa: E402

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.step.capture import StepRunner
from dlm_toolkit.models.distributed import init_from_env
from dlm_toolkit.models import LLaDA2Config, LLaDA2MoeModelLM, TensorParallel, load_model, save_model

# The official LLaDA2.1 configs (the fields the model reads). mini: inclusionAI/LLaDA2.1-mini
# config.json; flash: inclusionAI/LLaDA2.1-flash config.json (the routing groups are those of the family's configs).
COMMON = dict(
    vocab_size=157184, head_dim=128, num_shared_experts=1, num_experts=256, num_experts_per_tok=8, n_group=8,
    topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=600000.0,
    partial_rotary_factor=0.5, max_position_embeddings=32768, mask_token_id=156895, eos_token_id=156892,
)
SHAPES: dict[str, dict[str, Any]] = {
    "mini": dict(COMMON, hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=5120, moe_intermediate_size=512),
    "flash": dict(COMMON, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=4,
                  intermediate_size=9216, moe_intermediate_size=1024),
    # The same architecture scaled down for CPUs and CI (seconds per run).
    "smoke": dict(COMMON, vocab_size=2048, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
                  num_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, mask_token_id=2047,
                  eos_token_id=2046),
}
PRESETS = {"Q": "llada2.1-q", "S": "llada2.1-s"}
PROMPT_LENGTHS = (48, 64, 80, 96, 112, 128, 144, 160) * 4  # the fixed prompt set; batch b takes the first b


def config(shape: str, layers: int | None = None) -> LLaDA2Config:
    return LLaDA2Config(**dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})))


def preset_policy(preset: str, block: int) -> DecodingPolicy:
    """Preset ``Q`` or ``S`` at block length ``block``."""
    return DecodingPolicy(PRESETS[preset], **{"blocks.params.block_length": block})


def prompts(cfg: LLaDA2Config, batch: int) -> list[list[int]]:
    """Fixed pseudo-random prompts (seeded), ids below the special tokens."""
    gen = torch.Generator().manual_seed(1234)
    top = min(cfg.mask_token_id, cfg.eos_token_id)
    return [torch.randint(0, top, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS[:batch]]


@torch.no_grad()
def random_model(cfg: LLaDA2Config, dtype: torch.dtype, device: torch.device, tp: TensorParallel,
                 logit_scale: float, seed: int = 0) -> LLaDA2MoeModelLM:
    """This rank's shard of one random model, the same model on any number of ranks: each
    checkpoint tensor is N(0, initializer_range) from a generator keyed by (seed, tensor name),
    drawn on the device (a CPU init of 16B parameters would take minutes) at its full size and
    sliced to this rank's part, so a 2-rank run decodes the model a 1-rank run decodes. Experts
    are tensors of their own, so a rank draws only the experts it holds. Unit norms, a zero expert
    bias, a scaled lm_head without the mask token."""
    with torch.device("meta"):
        model = LLaDA2MoeModelLM(cfg, dtype=dtype, tp=tp)
        full = LLaDA2MoeModelLM(cfg, dtype=dtype) if tp.world > 1 else model
    full_shapes = {name: t.shape for name, t in full.state_dict().items()}
    model.to_empty(device=device)
    gen = torch.Generator(device=device)
    for name, t in model.state_dict().items():
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("expert_bias"):
            t.zero_()
        else:
            gen.manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
            whole = torch.empty(full_shapes[name], dtype=t.dtype, device=device).normal_(
                0.0, cfg.initializer_range, generator=gen)
            t.copy_(torch.cat([whole[s] for s in model.checkpoint_slices(name)]))
    model.lm_head.weight.mul_(logit_scale)
    model.lm_head.weight[cfg.mask_token_id].zero_()
    return model.eval()


class TimedModel:
    """Forwards to ``model``; accumulates the time spent in ``forward_window`` (CUDA events on a
    GPU, read once at the end, so timing adds no host sync)."""

    def __init__(self, model: LLaDA2MoeModelLM, device: torch.device):
        self.model, self.cuda = model, device.type == "cuda"
        self.events: list[tuple[Any, Any]] = []
        self.host_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def forward_window(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self.model.forward_window(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return out
        t0 = time.perf_counter()
        out = self.model.forward_window(*args, **kwargs)
        self.host_s += time.perf_counter() - t0
        return out

    def forward_seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        return self.host_s

    def reset(self) -> None:
        self.events, self.host_s = [], 0.0


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on a GPU; peak resident memory of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(model: LLaDA2MoeModelLM, shape: str, device: torch.device, batches: list[int], presets: list[str],
        gen_length: int, block: int, moe_impl: str) -> list[dict[str, Any]]:
    """One record per (preset, batch): the decode eagerly (``ms_per_forward`` by CUDA events around
    each forward) and, on a GPU, with CUDA graphs (``*_graphs``), side by side, plus the step
    forward's cost against the weight-read bound (:func:`forward_record`, per batch)."""
    dtype, cfg, tp = model.dtype, model.config, model.tp
    model.set_moe_impl(moe_impl)
    timed = TimedModel(model, device)
    graphs = device.type == "cuda"
    bandwidth = copy_bandwidth(device)
    forwards = {batch: forward_record(model, device, batch, block, gen_length, bandwidth) for batch in batches}
    records = []
    for preset in presets:
        policy = preset_policy(preset, block)
        for batch in batches:
            batch_prompts = prompts(cfg, batch)
            decode(timed, batch_prompts, policy, block, cuda_graphs=False)  # warm-up (kernels, allocator)
            timed.reset()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            result = decode(timed, batch_prompts, policy, gen_length, cuda_graphs=False)
            forward_s = timed.forward_seconds()
            s = result.summary()
            record = {
                "shape": shape, "layers": cfg.num_hidden_layers, "preset": preset, "batch": batch, "block_length": block, "gen_length": gen_length,
                "dtype": str(dtype).removeprefix("torch."), "moe_impl": moe_impl, "world_size": tp.world,
                "tokens_per_second": s["tokens_per_second"], "ms_per_forward": 1e3 * forward_s / result.forward_calls,
                "nfe_mean": s["nfe_mean"], "tpf": s["tpf"], "forward_calls": result.forward_calls,
                "engine_overhead_fraction": max(0.0, 1.0 - forward_s / result.wall_time),
                "wall_time_s": result.wall_time, "peak_memory_gb": peak_memory_bytes(device) / 1e9,
                "device": device_name(device),
                "tokens_per_second_graphs": None, "wall_time_s_graphs": None, "tokens_identical_graphs": None,
            }
            if graphs:
                decode(model, batch_prompts, policy, block, cuda_graphs=True)  # warm-up: captures
                replayed = decode(model, batch_prompts, policy, gen_length, cuda_graphs=True)
                record.update(tokens_per_second_graphs=replayed.summary()["tokens_per_second"],
                              wall_time_s_graphs=replayed.wall_time,
                              tokens_identical_graphs=[r.tokens for r in replayed.rows] == [r.tokens for r in result.rows])
            records.append({**record, **forwards[batch]})
    return records


def step_inputs(model: LLaDA2MoeModelLM, batch: int, block: int, gen_length: int):
    """A decode step's forward for ``batch`` prompts, shape-static as the engine runs it: the KV
    cache holds each row's whole blocks of prompt (prefilled here by one forward), the window is
    the next ``block`` positions, attention spans the whole cache buffer (the cached length is in
    the mask). Returns (cache, args of ``forward_window`` after the cache: ids, positions, mask,
    cache rows, cache writes (none), number of tokens)."""
    cfg, device = model.config, model.lm_head.weight.device
    rows = prompts(cfg, batch)
    cached = torch.tensor([len(p) // block * block for p in rows], device=device)  # (B,)
    length = -(-max(len(p) for p in rows) // block) * block + gen_length
    ids = torch.full((batch, length), cfg.mask_token_id, dtype=torch.long, device=device)
    for r, p in enumerate(rows):
        ids[r, : len(p)] = torch.tensor(p, device=device)
    pos = torch.arange(length, device=device).expand(batch, length)
    cache = model.new_cache(batch, length)
    every = torch.arange(batch, device=device)
    upto = int(cached.max())
    real = pos[:, :upto] < cached[:, None]  # (B, P)
    causal = (pos[:, None, :upto] // block) <= (pos[:, :upto, None] // block)
    window = (causal & real[:, None, :]) | torch.eye(upto, dtype=torch.bool, device=device)
    no_cache = torch.zeros(batch, upto, length, dtype=torch.bool, device=device)
    with torch.inference_mode():
        model.forward_window(ids[:, :upto], pos[:, :upto], torch.cat([no_cache, window], -1), cache=cache,
                             cache_rows=every, cache_write=real)
    step_pos = cached[:, None] + torch.arange(block, device=device)  # (B, T)
    in_cache = pos[:, None, :].expand(batch, block, length) < cached[:, None, None]
    mask = torch.cat([in_cache, torch.ones(batch, block, block, dtype=torch.bool, device=device)], -1)
    step_ids = ids.gather(1, step_pos)
    nowrite = torch.zeros(batch, block, dtype=torch.bool, device=device)
    return cache, (step_ids, step_pos, mask, every, nowrite)


def forward_record(model: LLaDA2MoeModelLM, device: torch.device, batch: int, block: int, gen_length: int,
                   bandwidth: float) -> dict[str, Any]:
    """The step forward at ``batch`` rows: time, ops and kernels per forward eagerly and (on a GPU)
    replayed from a CUDA graph, and the weight-read bound from the experts this forward routed to
    (``bound_ms_per_forward`` = bytes / measured copy rate; ``fraction_of_bound`` = bound / time)."""
    cache, args = step_inputs(model, batch, block, gen_length)

    def step(ids, pos, mask, rows, write):
        return model.forward_window(ids, pos, mask, cache=cache, cache_rows=rows, cache_write=write)

    with torch.inference_mode():
        hit = experts_hit(model, lambda: step(*args))
        need = weight_bytes(model, hit, batch * block)
        eager = forward_stats(lambda: step(*args), device)
        graphs: dict[str, Any] = dict.fromkeys(eager, None)
        if device.type == "cuda":
            runner = StepRunner(step, f"forward (batch {batch})", "cuda_graphs")
            graphs = forward_stats(lambda: runner(*args), device)
    bound_ms = 1e3 * need["total"] / bandwidth
    out: dict[str, Any] = {
        "step_ms_per_forward": eager["ms_per_forward"], "step_ms_per_forward_graphs": graphs["ms_per_forward"],
        "gpu_busy_fraction": eager["gpu_busy_fraction"], "gpu_busy_fraction_graphs": graphs["gpu_busy_fraction"],
        "aten_ops_per_forward": eager["aten_ops_per_forward"], "kernels_per_forward": eager["kernels_per_forward"],
        "experts_hit_per_moe_layer": sum(hit) / max(1, len(hit)), "bytes_per_forward": need["total"],
        "expert_bytes_per_forward": need["experts"], "copy_bandwidth_gb_s": bandwidth / 1e9,
        "bound_ms_per_forward": bound_ms, "fraction_of_bound": bound_ms / eager["ms_per_forward"],
        "fraction_of_bound_graphs": None if graphs["ms_per_forward"] is None else bound_ms / graphs["ms_per_forward"],
    }
    return out


def roundtrip(model: LLaDA2MoeModelLM, folder: str, device: torch.device, batch: int, presets: list[str],
               gen_length: int, block: int, moe_impl: str) -> dict[str, Any]:
    """Save ``model`` in the official format, load it back onto ``device``, decode ``batch`` prompts
    with each preset through both and compare the tokens."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    save_model(model, folder, max_shard_bytes=5 * 10**9)
    t1 = time.perf_counter()
    loaded = load_model(folder, dtype=model.dtype, device=device).set_moe_impl(moe_impl)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    batch_prompts = prompts(model.config, batch)
    identical = {}
    for preset in presets:
        policy = preset_policy(preset, block)
        a, b = (decode(m, batch_prompts, policy, gen_length) for m in (model, loaded))
        identical[preset] = [r.tokens for r in a.rows] == [r.tokens for r in b.rows]
    params = sum(t.numel() for t in model.state_dict().values())
    files = list(Path(folder).glob("*.safetensors"))
    return {"roundtrip": folder, "layers": model.config.num_hidden_layers, "parameters": params,
            "bytes": sum(f.stat().st_size for f in files), "files": len(files), "save_s": t1 - t0, "load_s": t2 - t1,
            "tokens_identical": identical, "device": device_name(device)}


def profile(model: LLaDA2MoeModelLM, device: torch.device, batch: int, preset: str, block: int) -> str:
    """torch.profiler table (top 25 by device time, or CPU time on a CPU) of one 64-token decode."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    policy = preset_policy(preset, block)
    batch_prompts = prompts(model.config, batch)
    decode(model, batch_prompts, policy, block)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        result = decode(model, batch_prompts, policy, 64)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return (f"profile: {preset} batch {batch}, {result.forward_calls} forwards, wall {result.wall_time:.3f} s\n"
            + prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))


def memory_per_rank(shape: str, world: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Weights of one rank (GB; router in float32 as loaded) and its KV cache per 1,000 cached
    positions of one row (GB), from the shapes (built on the meta device)."""
    cfg = config(shape)
    with torch.device("meta"):
        model = LLaDA2MoeModelLM(cfg, dtype=dtype, tp=TensorParallel(0, world))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    kv_lo, kv_hi = model.tp.kv_heads(cfg.num_key_value_heads)
    kv = 2 * cfg.num_hidden_layers * (kv_hi - kv_lo) * cfg.head_dim * 1000 * torch.finfo(dtype).bits // 8
    return {"weights_gb": weights / 1e9, "kv_gb_per_1k_positions": kv / 1e9}


def memory_table() -> str:
    lines = ["| shape | parameters | ranks | weights per rank (GB, bf16) | KV cache per rank per 1k positions per row (GB) |",
             "|---|---|---|---|---|"]
    for shape in ("mini", "flash"):
        with torch.device("meta"):
            params = sum(p.numel() for p in LLaDA2MoeModelLM(config(shape)).parameters())
        for world in (1, 2, 4, 8):
            m = memory_per_rank(shape, world)
            lines.append(f"| {shape} | {params / 1e9:.2f}B | {world} | {m['weights_gb']:.1f} | "
                         f"{m['kv_gb_per_1k_positions']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: mini on a GPU, smoke on a CPU")
    parser.add_argument("--cpu-smoke", action="store_true", help="the scaled-down shape on the CPU")
    parser.add_argument("--batch", type=int, nargs="+", choices=range(1, len(PROMPT_LENGTHS) + 1),
                        help="default: 1 8 32 on a GPU, 1 8 on a CPU")
    parser.add_argument("--presets", nargs="+", default=["Q", "S"], choices=sorted(PRESETS))
    parser.add_argument("--gen-length", type=int, default=None, help="default: 256 (64 for the smoke shape)")
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--logit-scale", type=float, default=None, help="lm_head scale (default 8, smoke 30)")
    parser.add_argument("--moe-impl", choices=["grouped", "reference"], default="grouped")
    parser.add_argument("--layers", type=int, help="build only the first N layers (default: the shape's all)")
    parser.add_argument("--roundtrip", metavar="DIR", help="then save to DIR, load back, compare decoded tokens")
    parser.add_argument("--profile", action="store_true",
                        help="then profile one 64-token decode (first preset, largest batch): top kernels and ops")
    parser.add_argument("--memory-table", action="store_true", help="print the memory-per-rank table and exit")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    if args.memory_table:
        print(memory_table())
        return 0
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if args.cpu_smoke and args.shape not in (None, "smoke"):
        parser.error("--cpu-smoke runs the smoke shape; drop --shape")
    shape = args.shape or ("mini" if cuda else "smoke")
    if shape != "smoke" and not cuda:
        parser.error(f"--shape {shape}: needs CUDA (this machine has none); use --cpu-smoke")
    tp, device = init_from_env("cuda" if cuda else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    smoke = shape == "smoke"
    dtype = torch.bfloat16 if device.type == "cuda" or not smoke else torch.float32
    model = random_model(config(shape, args.layers), dtype, device, tp, args.logit_scale or (30.0 if smoke else 8.0))
    gen_length = args.gen_length or (64 if smoke else 256)
    args.batch = args.batch or ([1, 8, 32] if device.type == "cuda" else [1, 8])
    records = run(model, shape, device, args.batch, args.presets, gen_length, args.block_length, args.moe_impl)
    if args.profile:
        print(profile(model, device, max(args.batch), args.presets[0], args.block_length))
    if args.roundtrip:
        if tp.world > 1:
            parser.error("--roundtrip: run it in one process (save_model writes a whole model)")
        records.append(roundtrip(model, args.roundtrip, device, max(args.batch), args.presets, gen_length,
                                 args.block_length, args.moe_impl))
    for r in records:
        if args.json or "roundtrip" in r:
            print(json.dumps(r))
        else:
            print(f"{r['shape']} {r['preset']} batch {r['batch']}: {r['tokens_per_second']:.1f} tok/s, "
                  f"{r['ms_per_forward']:.2f} ms/forward, NFE {r['nfe_mean']:.1f}, TPF {r['tpf']:.2f}, "
                  f"overhead {r['engine_overhead_fraction']:.3f}, peak {r['peak_memory_gb']:.2f} GB, {r['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
