"""Tensor + expert parallel LLaDA2 over torch.distributed: real gloo processes started by torchrun
give exactly the single-process tokens and NFE; each rank's shard sums to the whole model."""

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import tp_worker
from tp_worker import DLM, TORCHRUN, run_bounded

from dlm_toolkit.models.distributed import init_from_env, is_main_process
from dlm_toolkit.models import CheckpointError, LLaDA2MoeModelLM, TensorParallel, load_model, save_model
from dlm_toolkit.models.llada2 import Rope
from dlm_toolkit.testing import tiny_llada2, tiny_llada2_config

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "conformance/llada2_tiny"


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory) -> Path:
    """One KV head (so 2 ranks replicate it), 16 experts in 4 groups, 3 layers (1 dense)."""
    path = tmp_path_factory.mktemp("tp") / "random"
    save_model(tiny_llada2(7, num_key_value_heads=1, num_experts=16, num_experts_per_tok=4, n_group=4,
                           topk_group=2, num_hidden_layers=3), path)
    return path


def test_two_gloo_ranks_decode_exactly_like_one_process(random_checkpoint, tmp_path):
    proc = run_bounded([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(REPO / "tests/tp_worker.py"),
                        str(random_checkpoint), str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r.pop("world") for r in ranks] == [2, 2]
    single = tp_worker.run(random_checkpoint)
    assert single["failures"] == [] and len(single) == 1 + 17 * 2 + 3
    assert ranks[0] == single  # tokens and NFE of every fixture case and random-model row
    assert ranks[1] == single
    assert ranks[0]["failures"] == []  # and the fixture's logits, expected values and traces


def test_world_size_that_does_not_divide_the_model_fails_on_every_rank():
    proc = run_bounded([*TORCHRUN, "--standalone", "--nproc-per-node", "3", "--no-python", DLM, "decode", "--checkpoint",
                        str(FIXTURE), "--prompt-ids", "1,2", "--gen-length", "8", "--mask-id", "127", "--eos-id", "126"])
    assert proc.returncode != 0 and proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # each rank checks before any collective; torchrun stops the others once one exits, so under load
    # not every rank gets to print -- but those that do print the refusal, and none hangs
    assert 1 <= len(errors) <= 3, errors
    assert all("num_attention_heads=4 is not divisible by the world size 3" in e for e in errors), errors
    assert "exitcode  : 2" in proc.stderr  # each rank's own exit status (torchrun itself exits 1)


# -- shards in one process ------------------------------------------------------------------


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.float32), (4, torch.float32), (2, torch.bfloat16)])
@torch.no_grad()
def test_rank_shards_sum_to_the_whole_sublayers(tmp_path, world, dtype):
    """Each sub-layer's partial outputs over the ranks add up (in float32, as the all-reduce adds)
    to the single-device output, for split KV heads (world 2) and replicated ones (world 4 > 2 KV
    heads); in bf16 within bf16 rounding."""
    cfg = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=4, num_experts=8, num_experts_per_tok=2,
               n_group=4, topk_group=2, intermediate_size=48, num_hidden_layers=2)
    save_model(tiny_llada2(11, **cfg), tmp_path)
    full = load_model(tmp_path, dtype=dtype)
    shards = [load_model(tmp_path, dtype=dtype, tp=TensorParallel(r, world)) for r in range(world)]
    kv = [s.tp.kv_heads(2) for s in shards]
    assert kv == ([(0, 1), (1, 2)] if world == 2 else [(0, 1), (0, 1), (1, 2), (1, 2)])
    assert all(s.model.layers[0].attention.nkv == 1 and s.model.layers[0].attention.nq == 8 // world for s in shards)
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    pos = torch.arange(6).expand(2, 6)
    rope = Rope.build(pos, full.config.rotary_dim, full.config.head_dim, full.config.rope_theta, dtype)
    mask = (torch.arange(6)[None, :] // 3 <= torch.arange(6)[:, None] // 3).expand(2, 1, 6, 6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2

    def close(parts, whole):
        total = sum(p.float() for p in parts).to(dtype)
        return (total.float() - whole.float()).abs().max() <= tol * whole.float().abs().max()

    for layer in range(2):
        whole = full.model.layers[layer]
        parts = [s.model.layers[layer] for s in shards]
        assert close([p.attention(x, rope, mask) for p in parts], whole.attention(x, rope, mask))
        if layer == 0:
            assert close([p.mlp(x) for p in parts], whole.mlp(x))
        else:
            for impl in ("grouped", "reference"):
                assert close([s.set_moe_impl(impl).model.layers[1].mlp(x) for s in shards], whole.mlp(x)), impl
    experts = [s.model.layers[1].mlp.experts for s in shards]
    assert [e.first for e in experts] == [r * 8 // world for r in range(world)]
    assert all(e.gate_proj.shape[0] == 8 // world for e in experts)


def test_shard_sizes_add_up(tmp_path):
    save_model(tiny_llada2(2), tmp_path)
    full = sum(t.numel() for t in load_model(tmp_path).state_dict().values())
    shards = [load_model(tmp_path, tp=TensorParallel(r, 2)).state_dict() for r in range(2)]
    replicated = sum(t.numel() for k, t in shards[0].items() if "norm" in k or "embeddings" in k or "lm_head" in k
                     or ".gate." in k)
    assert sum(sum(t.numel() for t in s.values()) for s in shards) == full + replicated
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in shards[1] and "model.layers.1.mlp.experts.3.up_proj.weight" not in shards[1]
    with pytest.raises(ValueError, match="shard"):
        save_model(load_model(tmp_path, tp=TensorParallel(1, 2)), tmp_path / "out")


def test_world_size_errors_name_the_field_and_what_fits():
    with pytest.raises(ValueError, match=r"num_experts=8 is not divisible by the world size 16.*fit this model: 1, 2, 4, 8\)"):
        LLaDA2MoeModelLM(tiny_llada2_config(num_attention_heads=16, num_key_value_heads=2, head_dim=4),
                         tp=TensorParallel(0, 16))


def test_outside_torchrun_nothing_is_initialised(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tp, device = init_from_env(None)
    assert (tp.world, tp.rank, device) == (1, 0, torch.device("cpu")) and is_main_process()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE: must be an integer, got 'two'"):
        init_from_env("cpu")


def test_a_rank_reads_only_its_slices(tmp_path, monkeypatch):
    """Sharded tensors are read through ``get_slice`` (only those bytes), never whole; other ranks'
    experts are not read at all."""
    import dlm_toolkit.models.checkpoint as checkpoint

    save_model(tiny_llada2(2), tmp_path)
    whole, sliced = [], []
    real = checkpoint.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self.f = real(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            sliced.append(key)
            return self.f.get_slice(key)

        def get_tensor(self, key):
            whole.append(key)
            return self.f.get_tensor(key)

    monkeypatch.setattr(checkpoint, "safe_open", Spy)
    model = load_model(tmp_path, tp=TensorParallel(1, 2))
    assert "model.layers.0.attention.query_key_value.weight" not in whole
    assert not any(k.endswith(("dense.weight", "shared_experts.up_proj.weight")) or ".mlp.down_proj" in k for k in whole)
    experts_read = {k.split(".experts.")[1].split(".")[0] for k in whole if ".experts." in k}
    assert experts_read == {"4", "5", "6", "7"}
    assert "model.word_embeddings.weight" in whole and model.tp.rank == 1


def test_a_rank_missing_a_shard_file_gets_one_clear_error(tmp_path):
    save_model(tiny_llada2(2), tmp_path, max_shard_bytes=20_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(CheckpointError, match=rf"shards listed but not found \(1\): {shards[-1].name}"):
        load_model(tmp_path, tp=TensorParallel(1, 2))


def test_eval_on_a_non_main_rank_tracks_nothing(tmp_path, monkeypatch, capsys):
    """Under torchrun every rank computes the same result; only rank 0 logs it to MLflow."""
    from dlm_toolkit.cli import main

    monkeypatch.setenv("RANK", "1")
    db = tmp_path / "mlflow.db"
    assert main(["eval", "--checkpoint", str(REPO / "checkpoints/testbed-editable"), "--task", "add", "--n", "2",
                 "--seed", "0", "--json", "--no-progress", "--tracking-uri", f"sqlite:///{db}"]) == 0
    assert json.loads(capsys.readouterr().out)["mlflow_run_id"] is None and not db.exists()


def test_a_rank_whose_peer_vanished_still_exits(tmp_path):
    """The exit barrier waits for peers, never for ever: rank 1 dies without shutting down, rank 0
    exits normally, within the wait."""
    script = tmp_path / "vanish.py"
    script.write_text(
        "import os, sys, time\n"
        "import dlm_toolkit.models.distributed as d\n"
        "d.SHUTDOWN_WAIT_S = 5.0\n"
        "tp, _ = d.init_from_env('cpu')\n"
        "if tp.rank == 1:\n"
        "    os._exit(0)\n"
        "time.sleep(1.0)\n"
        "print('rank 0 done', flush=True)\n"
    )
    t0 = time.perf_counter()
    proc = run_bounded([*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(script)], timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0 done" in proc.stdout and time.perf_counter() - t0 < 45
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]  # the failed barrier is expected, not reported


# -- ranks agree or all stop ------------------------------------------------------------------


def _per_rank(tmp_path: Path, ckpts: dict[int, Path | None], seeds: tuple[int, int] = (3, 3),
              dtypes: tuple[str, str] = ("float32", "float32")) -> subprocess.CompletedProcess:
    """`dlm decode` on 2 gloo ranks, each started in its own folder ``r<RANK>`` holding its own
    ``ckpt`` (a copy, or none): the command line names the same relative ``ckpt`` on both ranks."""
    for rank, ckpt in ckpts.items():
        (tmp_path / f"r{rank}").mkdir()
        if ckpt is not None:
            shutil.copytree(ckpt, tmp_path / f"r{rank}" / "ckpt")
    script = ('cd "r$RANK" && if [ "$RANK" = 0 ]; then S={0}; D={2}; else S={1}; D={3}; fi && exec {4} decode '
              '--checkpoint ckpt --prompt-ids 5,9,2 --gen-length 8 --seed "$S" --dtype "$D" --device cpu'
              ).format(*seeds, *dtypes, DLM)
    return run_bounded([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--no-python", "sh", "-c", script],
                       timeout=180, cwd=tmp_path)


def _rank_errors(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout
    assert "Traceback" not in proc.stderr.replace("Traceback (most recent call last)", "") or "error: " in proc.stderr
    return [line.split("error: ", 1)[1] for line in proc.stderr.splitlines() if "error: " in line]


@pytest.mark.parametrize("case", ["seed", "weights", "missing"])
def test_ranks_that_differ_all_stop_naming_the_rank_and_the_field(random_checkpoint, tmp_path, case):
    """Another seed, other weights behind the same path, or no checkpoint on rank 1: every rank
    exits 2 with one line naming the field, before loading weights (the agreeing case is
    test_two_gloo_ranks_decode_exactly_like_one_process; dtypes and files: the unit tests below)."""
    other = tmp_path / "other"
    save_model(tiny_llada2(8, num_key_value_heads=1, num_experts=16, num_experts_per_tok=4, n_group=4,
                           topk_group=2, num_hidden_layers=3), other)  # same architecture, other weights
    ckpts = {0: random_checkpoint, 1: {"weights": other, "missing": None}.get(case, random_checkpoint)}
    proc = _per_rank(tmp_path, ckpts, seeds=(3, 4) if case == "seed" else (3, 3))
    errors = _rank_errors(proc)
    expected = {
        "seed": "ranks disagree on argument 9 (--seed): rank 0 has '3', rank 1 has '4';",
        "weights": "ranks disagree on argument 3 (--checkpoint) content of ckpt: rank 0 has '",
        "missing": "ranks disagree on argument 3 (--checkpoint) content of ckpt: rank 0 has '",
    }[case]
    # torchrun stops the other rank once one exits, so under load not both may print; none hangs
    assert 1 <= len(errors) <= 2 and all(e.startswith(expected) for e in errors), proc.stderr[-3000:]
    if case == "missing":
        assert all(e.split("rank 1 has ")[1].startswith("'missing'") for e in errors), errors
    assert "exitcode  : 2" in proc.stderr


def test_run_fields_name_every_argument_and_digest_the_files_they_name(tmp_path):
    from dlm_toolkit.models.distributed import file_digest, run_fields

    (tmp_path / "p.json").write_text('{"a": 1}')
    base = ["dlm", "decode", "--checkpoint", str(tmp_path), "--policy", str(tmp_path / "p.json"), "--seed", "3",
            "--dtype=float32", "-1.5"]
    fields = run_fields(base)
    assert fields["argument 7 (--seed)"] == "3" and fields["argument 8 (--dtype)"] == "float32"
    assert fields["argument 9 (positional)"] == "-1.5"  # a negative number is a value, not an option
    policy = f"argument 5 (--policy) content of {tmp_path / 'p.json'}"
    assert fields[policy] == file_digest(str(tmp_path / "p.json"))
    (tmp_path / "p.json").write_text('{"a": 2}')
    assert run_fields(base)[policy] != fields[policy]
    assert run_fields(base)[f"argument 3 (--checkpoint) content of {tmp_path}"] != \
        fields[f"argument 3 (--checkpoint) content of {tmp_path}"]  # a file in the folder changed
    assert run_fields([*base[:4], "--policy", str(tmp_path / "gone.json")])[
        f"argument 5 (--policy) content of {tmp_path / 'gone.json'}"] == "missing"


def test_a_large_file_digest_sees_a_changed_sample_and_its_size(tmp_path):
    from dlm_toolkit.models.distributed import SAMPLES, SMALL_FILE, file_digest

    size = SMALL_FILE * 4
    data = bytearray(size)
    (tmp_path / "w").write_bytes(data)
    first = file_digest(str(tmp_path / "w"))
    at = size * 3 // (SAMPLES + 1) + 10  # inside the third sample
    data[at] = 1
    (tmp_path / "w").write_bytes(data)
    assert file_digest(str(tmp_path / "w")) != first
    data[at] = 0
    (tmp_path / "w").write_bytes(bytes(data) + b"\0")  # one byte longer, samples all zero
    assert file_digest(str(tmp_path / "w")) != first
