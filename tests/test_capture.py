"""StepRunner (dlm_toolkit.step.capture) and the capture contract of the LLaDA2 forward.

On a CPU, ``torch.compile(fullgraph=True, dynamic=False)`` is the check that a forward reads
nothing back to the host: a host read (``.item()``, ``nonzero``, ``.tolist()``) is a graph break,
and a graph break fails the compile. The backend is ``aot_eager`` (the same traced graph as
inductor, without generating code, so a test takes seconds and eager/compiled bits agree).

The CUDA-graph tests at the end are defined only where CUDA exists (not collected on a CPU
machine, rather than skipped).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from dlm_toolkit.step import capture
from dlm_toolkit.step.capture import StepRunner
from dlm_toolkit.models import LLaDA2MoeModelLM
from tests.test_model_llada2 import tiny_config

L, T = 24, 8  # canvas length (cache positions), window width


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LLaDA2MoeModelLM:
    return LLaDA2MoeModelLM(tiny_config(), dtype=dtype).init_weights(0).eval().to(device)


def window(block: int, rows: int, device: str = "cpu", seed: int = 0):
    """The inputs of block ``block``'s forward, shape-static: every forward attends over the whole
    cache buffer (L columns) plus the window, the cached length is in the mask only."""
    gen = torch.Generator().manual_seed(seed + block)
    ids = torch.randint(0, 32, (rows, T), generator=gen)
    pos = torch.arange(block * T, (block + 1) * T).expand(rows, T).contiguous()
    mask = torch.zeros(rows, T, L + T, dtype=torch.bool)
    mask[:, :, : block * T] = True  # finished blocks, from the cache
    mask[:, :, L:] = True  # the window itself
    write = torch.rand(rows, T, generator=gen) < 0.7  # a partial write, different per block
    return [t.to(device) for t in (ids, pos, mask, torch.arange(rows), write)]


def decode_blocks(mode: str, model: LLaDA2MoeModelLM, rows: int = 2, blocks: int = 3, device: str = "cpu",
                  backend: str = "aot_eager"):
    cache = model.new_cache(rows, L)

    def forward(ids, pos, mask, cache_rows, write):
        return model.forward_window(ids, pos, mask, cache=cache, cache_rows=cache_rows, cache_write=write)

    runner = StepRunner(forward, "llada2-forward", mode, backend=backend) if mode != "eager" else None
    outs = []
    with torch.inference_mode():
        for b in range(blocks):
            args = window(b, rows, device)
            logits = runner(*args) if runner else forward(*args)
            outs.append(logits.clone())
    return outs, cache, runner


def test_compiled_forward_with_cache_equals_eager_and_compiles_once():
    model = tiny_model()
    eager, eager_cache, _ = decode_blocks("eager", model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning would fail here
        compiled, compiled_cache, runner = decode_blocks("compile", model)
    # three blocks: different cache contents, positions and writes, one compilation
    assert runner.compilations == 1 and not runner.failed
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(eager_cache.k + eager_cache.v, compiled_cache.k + compiled_cache.v, strict=True):
        assert torch.equal(a[:, :, :L], b[:, :, :L])  # the spare slot L holds whatever landed last
    # the partial writes went where cache_write said, and nowhere else
    written = torch.zeros(2, L, dtype=torch.bool)
    for b in range(3):
        written[:, b * T:(b + 1) * T] = window(b, 2)[4]
    stored = eager_cache.k[0][:, :, :L].abs().sum((1, 3)) > 0  # (rows, L)
    assert torch.equal(stored, written)


def test_cache_writes_match_a_plain_loop():
    """An independent reference for the fixed-shape write: store each chosen entry one by one."""
    model = tiny_model()
    cache = model.new_cache(3, L)
    ids, pos, mask, _, write = window(1, 2, seed=5)
    rows = torch.tensor([2, 0])
    with torch.inference_mode():
        model.forward_window(ids, pos, mask, cache=cache, cache_rows=rows, cache_write=write)
        # keys of the window = layer 0's K before attention: recompute them with an uncached call
        # into a fresh cache written everywhere, then copy the chosen ones by hand
        full = model.new_cache(2, L)
        model.forward_window(ids, pos, mask[:, :, L:], cache=full, cache_rows=torch.arange(2),
                             cache_write=torch.ones_like(write))
    expected = torch.zeros_like(cache.k[0])
    for b in range(2):
        for t in range(T):
            if write[b, t]:
                p = int(pos[b, t])
                expected[rows[b], :, p] = full.k[0][b, :, p]
    assert torch.equal(cache.k[0][:, :, :L], expected[:, :, :L])


def test_new_shape_is_a_new_compilation():
    model = tiny_model()
    cache = model.new_cache(3, L)

    def forward(ids, pos, mask, cache_rows, write):
        return model.forward_window(ids, pos, mask, cache=cache, cache_rows=cache_rows, cache_write=write)

    runner = StepRunner(forward, "fwd", "compile", backend="aot_eager")
    with torch.inference_mode():
        for rows in (2, 3, 2, 3):
            runner(*window(0, rows))
    assert runner.compilations == 2


def test_runners_do_not_share_a_recompile_limit(monkeypatch):
    # one runner per (bucket, width, canvas) and model: dynamo's per-code-object recompile limit
    # (here 2) must not turn the third runner of one function eager
    monkeypatch.setattr(capture, "RECOMPILE_LIMIT", 2)

    def double(x):
        return x * 2

    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(4):
            runner = StepRunner(double, "double", "compile", backend="aot_eager")
            assert torch.equal(runner(torch.ones(3)), torch.full((3,), 2.0))
            assert runner.compilations == 1


HOST_READS = {
    "int item": lambda x: x * x.long().sum().item(),
    "int()": lambda x: x * int(x.sum()),
    "nonzero": lambda x: x[x.nonzero(as_tuple=True)].sum() * x,
    "bool index": lambda x: x[x > 1].sum() * x,
    "bool()": lambda x: x * 2 if bool(x.sum() > 0) else x,
    "unique": lambda x: x.unique().sum() * x,
    "bincount": lambda x: x.long().bincount().sum() * x,
}


@pytest.mark.parametrize("kind", HOST_READS)
def test_every_kind_of_host_read_is_refused(kind):
    fn = HOST_READS[kind]
    runner = StepRunner(fn, kind, "compile", backend="aot_eager")
    x = torch.arange(4.0)
    with pytest.warns(RuntimeWarning, match=re.escape(f"step '{kind}' cannot be captured")):
        out = runner(x)
    assert runner.failed and torch.equal(out, fn(x))


def test_host_read_falls_back_with_one_warning_and_same_result():
    def scaled(x):
        return x * x.sum().item()  # a host read (dynamo traces it; host_reads finds it)

    runner = StepRunner(scaled, "scaled-by-sum", "compile", backend="aot_eager")
    x = torch.arange(4.0)
    with pytest.warns(RuntimeWarning) as record:
        outs = [runner(x), runner(x + 1), runner(torch.ones(2, 2))]
    ours = [w for w in record if "scaled-by-sum" in str(w.message)]
    assert len(ours) == 1 and "eagerly" in str(ours[0].message)
    assert runner.failed and runner.compilations == 0
    for out, inp in zip(outs, [x, x + 1, torch.ones(2, 2)], strict=True):
        assert torch.equal(out, scaled(inp))


def test_reference_moe_path_is_not_capturable_and_falls_back():
    # the "reference" MoE reads expert counts on the host: never the capturable default
    model = tiny_model()
    eager, _, _ = decode_blocks("eager", model, blocks=1)
    model.set_moe_impl("reference")
    try:
        with pytest.warns(RuntimeWarning, match="llada2-forward"):
            out, _, runner = decode_blocks("compile", model, blocks=1)
    finally:
        model.set_moe_impl("grouped")
    assert runner.failed
    assert (out[0] - eager[0]).abs().max() < 1e-5


def test_bad_input():
    with pytest.raises(ValueError, match="mode: must be one of eager, compile, cuda_graphs, got 'graphs'"):
        StepRunner(lambda x: x, "s", "graphs")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step 's': argument 1 must be a tensor, got int"):
        StepRunner(lambda x, y: x, "s", "eager")(torch.ones(1), 3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^CUDA graphs need CUDA; the model is on cpu"):
            StepRunner(lambda x: x, "s", "cuda_graphs")


if torch.cuda.is_available():  # defined (collected) only on a machine with CUDA

    def test_cuda_graphs_on_cpu_tensor_is_one_line():
        runner = StepRunner(lambda x: x * 2, "s", "cuda_graphs")
        with pytest.raises(ValueError, match="^CUDA graphs need CUDA; the model is on cpu$"):
            runner(torch.ones(2))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_cuda_graphs_replay_equals_eager(dtype):
        model = tiny_model("cuda", dtype)
        eager, eager_cache, _ = decode_blocks("eager", model, blocks=3, device="cuda")
        graphs, graph_cache, runner = decode_blocks("cuda_graphs", model, blocks=3, device="cuda")
        assert runner.compilations == 1 and not runner.failed
        for a, b in zip(eager, graphs, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(eager_cache.k + eager_cache.v, graph_cache.k + graph_cache.v, strict=True):
            assert torch.equal(a[:, :, :L], b[:, :, :L])

    def test_cuda_graphs_host_read_falls_back():
        runner = StepRunner(lambda x: x * x.sum().item(), "host-read", "cuda_graphs")
        x = torch.arange(4.0, device="cuda")
        with pytest.warns(RuntimeWarning, match="host-read"):
            outs = [runner(x), runner(x), runner(x)]
        assert runner.failed and all(torch.equal(o, x * 6) for o in outs)
