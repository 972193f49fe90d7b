"""README "Full scale": its CPU commands run as written from a fresh shell (torchrun decode = single-process decode,
the benchmark's smoke shape alone and on 2 gloo ranks) and its memory table matches the shapes."""

import json
import shlex
import subprocess
import sys

import pytest
import torch
import readme_shell
from tp_worker import REPO, run_bounded

sys.path.insert(0, str(REPO / "benchmarks"))
import full_scale  # noqa: E402

from dlm_toolkit.cli import main  # noqa: E402
from dlm_toolkit.models import TensorParallel, load_model  # noqa: E402


def full_scale_section() -> str:
    return readme_shell.section("Full scale")


def cpu_commands() -> list[str]:
    blocks = readme_shell.bash_blocks(full_scale_section())
    assert len(blocks) == 1
    return blocks[0].splitlines()


def run_line(line: str) -> subprocess.CompletedProcess:
    """A README line as written, from a fresh shell after README's activation line."""
    return readme_shell.run(line, timeout=120)


def command(start: str) -> str:
    return next(c for c in cpu_commands() if c.startswith(start))


def records(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.strip().splitlines()]


def readme_torchrun_vs_single(line: str, capsys) -> tuple[dict, dict]:
    """(what the README's 2-rank line prints, what the same dlm command prints in this process)"""
    proc = run_line(line)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [both] = records(proc.stdout)  # one line: rank 1 is quiet
    words = shlex.split(line)
    assert main(words[words.index("dlm") + 1:]) == 0
    return both, json.loads(capsys.readouterr().out)


def test_readme_torchrun_decode_prints_once_the_single_process_result(capsys):
    both, single = readme_torchrun_vs_single(command("torchrun --standalone --nproc-per-node 2 --no-python -- dlm decode"), capsys)
    assert (both["tokens"], both["nfe"]) == (single["tokens"], single["nfe"])


def test_readme_torchrun_eval_equals_single_process(capsys):
    both, single = readme_torchrun_vs_single(command("torchrun --standalone --nproc-per-node 2 --no-python -- dlm eval"), capsys)
    for key in ("accuracy", "nfe_mean", "tpf", "edits_per_token", "forward_tokens_per_token", "n"):
        assert both[key] == single[key], key


def check_records(rows: list[dict], world: int) -> None:
    for r in rows:
        assert r["shape"] == "smoke" and r["world_size"] == world and r["block_length"] == 32
        assert r["device"].startswith("cpu") and r["peak_memory_gb"] > 0
        assert r["nfe_mean"] >= r["gen_length"] / r["block_length"] and r["forward_calls"] >= r["nfe_mean"]
        assert 0 < r["tpf"] <= r["block_length"] and r["tokens_per_second"] > 0 and r["ms_per_forward"] > 0
        assert 0 <= r["engine_overhead_fraction"] < 1


def test_readme_benchmark_smoke_runs_every_batch_and_preset():
    proc = run_line(command("python benchmarks/full_scale.py --cpu-smoke"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = records(proc.stdout)
    assert [(r["preset"], r["batch"]) for r in rows] == [("Q", 1), ("Q", 8), ("S", 1), ("S", 8)]
    check_records(rows, world=1)


def test_readme_benchmark_roundtrip_saves_the_official_format_and_decodes_the_same(tmp_path):
    line = command("python benchmarks/full_scale.py --cpu-smoke --json --layers 2")
    folder = tmp_path / "rt"
    proc = run_line(line.replace("runs/smoke-roundtrip", str(folder)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    *rows, trip = records(proc.stdout)
    assert [(r["preset"], r["batch"], r["layers"]) for r in rows] == [("Q", 2, 2), ("S", 2, 2)]
    assert trip["tokens_identical"] == {"Q": True, "S": True} and trip["layers"] == 2
    # what was written is the benchmark's seeded random model, under the official names
    loaded = load_model(folder)
    want = full_scale.random_model(full_scale.config("smoke", 2), torch.float32, torch.device("cpu"),
                                   TensorParallel(), logit_scale=30.0)
    got_state, want_state = loaded.state_dict(), want.state_dict()
    assert got_state.keys() == want_state.keys() and "model.layers.1.mlp.experts.31.down_proj.weight" in got_state
    for key, t in want_state.items():
        assert torch.equal(got_state[key], t), key
    assert trip["parameters"] == sum(t.numel() for t in want_state.values())


def test_readme_benchmark_smoke_on_two_gloo_ranks():
    proc = run_line(command("torchrun --standalone --nproc-per-node 2 benchmarks/full_scale.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = records(proc.stdout)
    assert [(r["preset"], r["batch"]) for r in rows] == [("S", 8)]
    check_records(rows, world=2)


def test_readme_memory_table_is_the_scripts():
    assert "python benchmarks/full_scale.py --memory-table" in cpu_commands()
    assert full_scale.memory_table() in full_scale_section()


def expected_bytes(c: dict, world: int) -> int:
    """Weights of one rank from the architecture, written out independently of the model code."""
    H, L, hd, V = c["hidden_size"], c["num_hidden_layers"], c["head_dim"], c["vocab_size"]
    nq, nkv, E = c["num_attention_heads"], c["num_key_value_heads"], c["num_experts"]
    kv_local = nkv // world if nkv % world == 0 else 1
    attention = H * (nq // world + 2 * kv_local) * hd + (nq // world) * hd * H + 2 * hd + 2 * H  # + 4 norms
    dense = 3 * H * c["intermediate_size"] // world
    moe = (E // world) * 3 * H * c["moe_intermediate_size"] + 3 * H * c["moe_intermediate_size"] // world
    router = E * H + E  # float32: 2 extra bytes per value
    layers = L * attention + dense + (L - 1) * moe + 2 * V * H + H
    return 2 * (layers + (L - 1) * router) + 2 * (L - 1) * router


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", ["mini", "flash"])
def test_memory_per_rank_matches_the_architecture(shape, world):
    got = full_scale.memory_per_rank(shape, world)["weights_gb"] * 1e9
    assert got == pytest.approx(expected_bytes(full_scale.SHAPES[shape], world), rel=1e-9)


def test_published_sizes():
    """The released configs: mini 16.26B parameters (~32.5 GB bf16), flash 102.9B (~206 GB)."""
    for shape, params, gb in (("mini", 16.26e9, 32.5), ("flash", 102.9e9, 205.8)):
        with torch.device("meta"):
            n = sum(p.numel() for p in full_scale.LLaDA2MoeModelLM(full_scale.config(shape)).parameters())
        assert n == pytest.approx(params, rel=1e-3)
        assert full_scale.memory_per_rank(shape, 1)["weights_gb"] == pytest.approx(gb, rel=1e-3)


def test_cpu_machine_refuses_the_full_shapes():
    if torch.cuda.is_available():
        pytest.skip("this check is about machines without CUDA")
    proc = run_bounded([sys.executable, "benchmarks/full_scale.py", "--shape", "mini"])
    assert proc.returncode == 2 and "--shape mini: needs CUDA" in proc.stderr


def test_benchmark_random_model_is_the_same_model_on_one_and_two_ranks():
    """The 2-rank benchmark decodes the model the 1-rank one decodes, so their numbers compare: every
    tensor of each rank's shard is that rank's part of the 1-rank tensor (experts: the same experts)."""
    cfg, cpu = full_scale.config("smoke", 2), torch.device("cpu")
    whole = full_scale.random_model(cfg, torch.float32, cpu, TensorParallel(), logit_scale=30.0).state_dict()
    held = set()
    for rank in (0, 1):
        tp = TensorParallel(rank=rank, world=2)
        shard = full_scale.random_model(cfg, torch.float32, cpu, tp, logit_scale=30.0)
        for key, t in shard.state_dict().items():
            want = torch.cat([whole[key][s] for s in shard.checkpoint_slices(key)])
            assert torch.equal(t, want), (rank, key)
            held.add(key)
    assert held == set(whole)  # the two shards hold every expert between them
    assert not torch.equal(whole["model.layers.1.mlp.experts.0.up_proj.weight"],
                           whole["model.layers.1.mlp.experts.1.up_proj.weight"])
