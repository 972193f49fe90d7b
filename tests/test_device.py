"""Full scale on one machine: the engine on any device and dtype, host syncs per step, and the
``--device/--dtype/--threads`` settings (``dlm_toolkit/util/runtime.py``)."""

import json
import random

import pytest
import torch

from dlm_toolkit import ConfigError, DecodingPolicy, decode
from dlm_toolkit.cli import main
from dlm_toolkit.models import load_model, save_model
from dlm_toolkit.util.runtime import resolve_device, resolve_dtype, resolve_threads, threads_scope
from dlm_toolkit.testing import HostSyncs, ScriptedLM, mixing_logits, tiny_llada2

V, MASK, EOS = 40, 39, 38


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_model(tiny_llada2(seed=5), path)
    return path


def syncs_per_forward(model, policy, prompts=((1, 2, 3), (4, 5, 6, 7, 8, 9))):
    """Host syncs each extra forward costs: two decodes of different lengths, same rows, so the
    fixed costs (start, result) cancel out."""
    counts = []
    for gen in (9, 29):
        with HostSyncs() as syncs:
            res = decode(model, [list(p) for p in prompts], policy, gen)
        counts.append((syncs.count, res.forward_calls))
    (c1, f1), (c2, f2) = counts
    assert f2 > f1
    return (c2 - c1) / (f2 - f1)


@pytest.mark.parametrize("preset", ["llada2.1-q", "llada2.1-s", "llada-lowconf"])
def test_one_host_read_per_step(preset):
    """Per forward the engine reads the device once (whether any row is live, the span the next
    forward needs, the last step's contract checks: one small vector). Rules, checks and writes
    add none."""
    model = ScriptedLM(mixing_logits(V, seed=1), V, MASK, EOS)
    overrides = {"blocks.params.block_length": 4, "blocks.params.eos_early_stop": False}
    if preset == "llada-lowconf":
        overrides["m2t.params.steps_per_block"] = 4
    assert syncs_per_forward(model, DecodingPolicy(preset, **overrides)) == 1


@pytest.mark.parametrize("overrides", [{"m2t.name": "klass"}, {"m2t.name": "credit"}, {"remask.name": "remdm"},
                                       {"m2t.name": "ancestral", "sampling.temperature": 1.0},
                                       {"blocks.name": "multi_block_edit"}])
def test_stateful_random_and_mbe_policies_add_no_sync(overrides):
    model = ScriptedLM(mixing_logits(V, seed=2), V, MASK, EOS)
    policy = DecodingPolicy("llada2.1-s", **{"blocks.params.block_length": 4, **overrides,
                                             "blocks.params.eos_early_stop": False})
    assert syncs_per_forward(model, policy) == 1


def test_llada2_decode_allocates_nothing_off_the_model_device():
    """The real model and the engine under a default device of ``meta``: every tensor made without
    ``device=`` would land there and fail against the CPU model."""
    model = tiny_llada2(seed=3)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    want = decode(model, prompts, "llada2.1-s", 20)
    for kv in (True, False):
        with torch.device("meta"):
            got = decode(model, prompts, "llada2.1-s", 20, kv_cache=kv)
        assert got.tokens == want.tokens and [r.nfe for r in got.rows] == [r.nfe for r in want.rows]


# -- bf16 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["llada2.1-q", "llada2.1-s", "llada2.0"])
def test_bf16_model_decodes_with_float32_confidences(preset, checkpoint):
    model = load_model(checkpoint, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2]]
    res = decode(model, prompts, preset, 24, record=True)
    assert all(model.mask_token_id not in row.tokens for row in res.rows)
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    for step in res.trajectory.steps:
        assert all(0.0 < c <= 1.0 for c in step.confidence)
    # KV cache on/off and batch invariance hold in bf16 too
    again = decode(model, prompts, preset, 24, kv_cache=False)
    assert again.tokens == res.tokens and [r.nfe for r in again.rows] == [r.nfe for r in res.rows]
    for i, p in enumerate(prompts):
        alone = decode(model, [p], preset, 24)
        assert alone.tokens[0] == res.tokens[i]


# -- runtime settings ----------------------------------------------------------------------------


def test_resolve_device_dtype_threads():
    assert resolve_device(None) == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_threads(None, small_model=True) == 1 and resolve_threads(None, small_model=False) is None
    import os

    cpus = os.cpu_count()
    assert resolve_threads(cpus, small_model=True) == cpus  # the machine's CPU count is the most accepted
    with pytest.raises(ConfigError, match=rf"threads: must be an integer in \[1, {cpus}\] \(this machine has {cpus} CPUs\)"):
        resolve_threads(cpus + 1, small_model=True)
    for bad, fragment in [("tpu", "device"), ("cuda:zero", "device"), ("xla", "device")]:
        with pytest.raises(ConfigError, match=fragment):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            resolve_device("cuda")
    with pytest.raises(ConfigError, match="int8"):
        resolve_dtype("int8", torch.device("cpu"))
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ConfigError, match="threads"):
            resolve_threads(bad, small_model=True)
    before = torch.get_num_threads()
    with threads_scope(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("args, fragment", [
    (["--device", "cuda"], "CUDA") if not torch.cuda.is_available() else (["--device", "cuda:99"], "cuda:99"),
    (["--device", "tpu"], "device"),
    (["--dtype", "int8"], "dtype"),
    (["--threads", "0"], "threads"),
])
def test_decode_cli_rejects_bad_runtime_settings(checkpoint, capsys, args, fragment):
    code = main(["decode", "--checkpoint", str(checkpoint), "--prompt-ids", "1,2,3", "--gen-length", "8", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and fragment in err and len(err.splitlines()) == 1


def test_decode_cli_in_bf16_with_threads(checkpoint, capsys):
    code = main(["decode", "--checkpoint", str(checkpoint), "--prompt-ids", "1,2,3", "--gen-length", "8",
                 "--dtype", "bfloat16", "--threads", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["nfe"] >= 1 and 63 not in out["tokens"]
    assert torch.get_num_threads() == 1


# -- sampling: each row its own stream -----------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {"sampling.temperature": 1.0},
    {"sampling.temperature": 1.0, "sampling.top_k": 5},
    {"sampling.temperature": 0.7, "sampling.top_p": 0.8, "sampling.gumbel_float64": True},
    {"m2t.name": "ancestral"},
    {"remask.name": "remdm", "remask.params.eta": 0.5, "t2t.name": "none", "m2t.name": "topk",
     "m2t.params.steps_per_block": 4, "blocks.params.block_length": 8},
    {"m2t.name": "topk", "m2t.params.ranking": "random", "m2t.params.steps_per_block": 4},
])
def test_batch_rows_equal_single_decodes_under_sampling(overrides):
    from dlm_toolkit.step.state import row_seed

    model = tiny_llada2(seed=6)
    policy = DecodingPolicy("llada2.1-s", **{"blocks.params.block_length": 4, **overrides})
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 62) for _ in range(rng.randint(1, 9))] for _ in range(4)]
    batch = decode(model, prompts, policy, 14, seed=11)
    for i, p in enumerate(prompts):
        alone = decode(model, [p], policy, 14, seed=[row_seed(11, i)])
        assert alone.tokens[0] == batch.tokens[i] and alone.rows[0].nfe == batch.rows[i].nfe
    def trace(res):
        return res.tokens, [(r.nfe, r.remasks, r.commits) for r in res.rows]

    assert any(trace(decode(model, prompts, policy, 14, seed=s)) != trace(batch) for s in (12, 13, 14))


def test_evaluate_is_independent_of_the_batch_size_at_temperature_1():
    from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint

    model, tok = load_checkpoint("checkpoints/testbed-editable")
    policy = DecodingPolicy("llada2.1-s", **{"sampling.temperature": 1.0, "remask.name": "remdm"})
    runs = [evaluate(model, tok, "add", policy, 12, seed=3, batch_size=k, progress=False) for k in (1, 5, 12)]
    outputs = [[r["completion"] for r in run.records] for run in runs]
    assert outputs[0] == outputs[1] == outputs[2]
    assert runs[0].metrics["accuracy"] == runs[2].metrics["accuracy"]


def test_seed_list_must_match_the_prompts():
    model = ScriptedLM(mixing_logits(V), V, MASK, EOS)
    with pytest.raises(ConfigError, match="seed"):
        decode(model, [[1], [2]], "llada2.1-q", 4, seed=[1, 2, 3])
