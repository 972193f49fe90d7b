"""The engine's forward side alone: CPU time (``time.process_time``, so load on other cores does
not count) spent inside ``StepEngine.forward`` per model call, and in the whole decode per call,
with zero-cost scripted models (a table lookup by position): ``nocache`` the plain
:class:`~dlm_toolkit.testing.ScriptedLM` (the canvas-wide forward of ``decode_speed.py``'s
``zero_model_ms_per_step``), ``cache`` the same claiming a KV cache (the cached path's window,
cache columns and writes). Preset llada2.1-q, block 32, 512 generated tokens, batch 1 and 8.

Run: ``OMP_NUM_THREADS=1 python benchmarks/engine_forward.py`` (best of ``--repeats``). To
compare two checkouts, run it from each (``PYTHONPATH=<checkout>``) on the same machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.decoding import engine as engine_module
from dlm_toolkit.testing import ScriptedLM

VOCAB, MASK, EOS = 512, 511, 510


class CachedZero(ScriptedLM):
    """The zero-cost scripted model on the KV-cache path (its cache holds nothing: the logits are a
    lookup by position, so what the engine would cache is never needed)."""

    supports_kv_cache = True

    def new_cache(self, batch_size: int, max_length: int) -> None:
        return None


def measure(repeats: int = 5, gen_length: int = 512) -> dict:
    table = torch.randn(1024, VOCAB, generator=torch.Generator().manual_seed(0)) * 8
    spent = [0.0]
    forward = engine_module.StepEngine.forward

    def timed(self, *args):
        t0 = time.process_time()
        out = forward(self, *args)
        spent[0] += time.process_time() - t0
        return out

    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 32, "blocks.params.eos_early_stop": False})
    out = {}
    engine_module.StepEngine.forward = timed
    try:
        for batch in (1, 8):
            prompts = [[(7 * i + r) % 500 for i in range(40 + 3 * r)] for r in range(batch)]
            for name, cls, kv in (("nocache", ScriptedLM, False), ("cache", CachedZero, True)):
                model = cls(lambda ids, pos, attn: table[pos], VOCAB, MASK, EOS)
                decode(model, prompts, policy, 64, kv_cache=kv)  # warm-up
                best_forward = best_decode = float("inf")
                for _ in range(repeats):
                    spent[0] = 0.0
                    t0 = time.process_time()
                    res = decode(model, prompts, policy, gen_length, kv_cache=kv)
                    total = time.process_time() - t0
                    best_forward = min(best_forward, spent[0] / res.forward_calls)
                    best_decode = min(best_decode, total / res.forward_calls)
                out[f"batch{batch}_{name}"] = {"forward_cpu_ms_per_call": round(1e3 * best_forward, 4),
                                               "decode_cpu_ms_per_call": round(1e3 * best_decode, 4),
                                               "forward_calls": res.forward_calls}
    finally:
        engine_module.StepEngine.forward = forward
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(measure(args.repeats), indent=1))


if __name__ == "__main__":
    main()
