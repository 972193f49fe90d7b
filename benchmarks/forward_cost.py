"""The cached forward's fixed cost (issue 43): aten ops per forward and CPU time per call of the small
decode model (``decode_speed.SMALL``) at 1 and 32 window tokens over 256 cached positions and at 544
tokens without a cache, plus the decode itself with and without the KV cache (``kv_cpu`` = CPU time
of the recompute loop / the cached loop, 512 tokens, block 32, preset llada2.1-q).

Run: ``python benchmarks/forward_cost.py [--json]`` for the tree on ``PYTHONPATH``, or
``python benchmarks/forward_cost.py --compare /work/main .`` to run each tree in turn (interleaved,
``--rounds`` times, one thread) and print the best of each with the ratios to the first tree: on a
shared machine only such back-to-back ratios mean something. CPU time (``time.process_time``) is
used, not wall time, so the waits of a loaded machine count less.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import SMALL  # noqa: E402

from dlm_toolkit import DecodingPolicy, decode  # noqa: E402
from dlm_toolkit.testing import tiny_llada2  # noqa: E402

CASES = (("1", 1, 256, 100), ("32", 32, 256, 30), ("544", 544, 0, 3))  # name, tokens, cached, calls


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _forward(model, T: int, S: int):
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, SMALL["vocab_size"] - 2, (1, T), generator=g)
    pos = torch.arange(S, S + T)[None]
    mask = torch.ones(1, T, S + T, dtype=torch.bool)
    if not S:
        return lambda: model.forward_window(ids, pos, mask)
    cache, rows, write = model.new_cache(1, 640), torch.zeros(1, dtype=torch.long), torch.ones(1, T, dtype=torch.bool)
    return lambda: model.forward_window(ids, pos, mask, cache=cache, cache_rows=rows, cache_write=write)


def measure(repeats: int = 3) -> dict:
    """Ops per forward and best-of-``repeats`` CPU ms per call for each case, then the decodes."""
    torch.set_num_threads(1)
    model = tiny_llada2(0, logit_scale=30.0, **SMALL)
    out: dict = {}
    with torch.inference_mode():
        for name, T, S, calls in CASES:
            fn = _forward(model, T, S)
            fn()
            with _Ops() as ops:
                fn()
            best = min(_cpu(lambda: [fn() for _ in range(calls)]) for _ in range(repeats)) / calls
            out[f"ops_{name}"], out[f"cpu_ms_{name}"] = ops.n, round(1e3 * best, 3)
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 32, "blocks.params.eos_early_stop": False})
    prompt = [[(7 * i) % 500 for i in range(40)]]
    decode(model, prompt, policy, 64)  # warm-up
    for kv in (True, False):
        runs = [_timed(lambda: decode(model, prompt, policy, 512, kv_cache=kv)) for _ in range(repeats)]
        key = "cached" if kv else "recompute"
        out[f"{key}_cpu_s"] = round(min(t for t, _ in runs), 3)
        out[f"{key}_tokens"] = hashlib.sha256(repr(runs[0][1].tokens).encode()).hexdigest()[:12]
        out[f"{key}_nfe"] = runs[0][1].rows[0].nfe
    out["kv_cpu"] = round(out["recompute_cpu_s"] / out["cached_cpu_s"], 3)
    out["tokens_identical"] = out["cached_tokens"] == out["recompute_tokens"]
    return out


def _cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _timed(fn):
    t0 = time.process_time()
    result = fn()
    return time.process_time() - t0, result


def compare(trees: list[str], rounds: int, repeats: int) -> dict:
    """Each tree's :func:`measure` in a fresh interpreter, the trees interleaved ``rounds`` times;
    the best (lowest) time of each field, and each tree's time over the first tree's."""
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(rounds):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=str(Path(tree).resolve()), OMP_NUM_THREADS="1")
            cmd = [sys.executable, str(Path(tree, "benchmarks", Path(__file__).name)), "--json", "--repeats", str(repeats)]
            if not Path(cmd[1]).exists():  # a tree without this script: run ours against its package
                cmd[1] = __file__
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(done.stdout.splitlines()[-1]))
    best = {t: {k: min(r[k] for r in rs) if isinstance(rs[0][k], float) else rs[0][k] for k in rs[0]}
            for t, rs in runs.items()}
    for b in best.values():  # the ratio of the best times, not the best ratio
        b["kv_cpu"] = round(b["recompute_cpu_s"] / b["cached_cpu_s"], 3)
    base = best[trees[0]]
    for t in trees[1:]:
        best[t]["time_over_first"] = {k: round(v / base[k], 3) for k, v in best[t].items()
                                      if k.startswith("cpu_ms_") or k.endswith("_cpu_s")}
        best[t]["kv_cpu_over_first"] = round(best[t]["kv_cpu"] / base["kv_cpu"], 3)
        best[t]["same_tokens_as_first"] = best[t]["cached_tokens"] == base["cached_tokens"]
    return {"rounds": rounds, "load_average": os.getloadavg(), "trees": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", nargs="+", metavar="TREE", help="source trees to run in turn (first = baseline)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.compare:
        print(json.dumps(compare(args.compare, args.rounds, args.repeats), indent=1))
        return
    result = measure(args.repeats)
    print(json.dumps(result) if args.json else "\n".join(f"{k:>18}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
