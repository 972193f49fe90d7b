"""The editable-dLLM training objective: batch layout, attention mask, noise, config, a tiny run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dlm_toolkit.training import loop as training
from dlm_toolkit.training import resume as training_resume
from dlm_toolkit.cli import main as cli_main
from dlm_toolkit.config import ConfigError
from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.tasks import get_task
from dlm_toolkit.models.tokenizer import build_char_tokenizer, special_ids
from dlm_toolkit.training import (
    TrainConfig,
    block_diffusion_attn_mask,
    build_model,
    canvas_tokens,
    corruption_candidates,
    load_train_config,
    loss_fn,
    make_batch,
    train,
)

TINY = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    intermediate_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, n_group=2,
    topk_group=1, max_position_embeddings=64,
)
TOK = build_char_tokenizer()
MASK, EOS = special_ids(TOK)


def rows_of(task, n, seed=0):
    enc = lambda s: TOK.encode(s, add_special_tokens=False)  # noqa: E731
    return [(enc(i.prompt), enc(i.reference)) for i in task.instances(n, seed, "train")]


def a_batch(config: TrainConfig, task_name="sort", block_length=8, n=6, seed=0, **task_kw):
    task = get_task(task_name, **task_kw)
    cands = corruption_candidates(task, TOK, EOS, config.corrupt_tokens)
    gen = torch.Generator().manual_seed(seed)
    return task, make_batch(rows_of(task, n, seed), task.answer_length, block_length, MASK, EOS, config, cands, gen), cands


# ---------------------------------------------------------------------------------------------- mask


def brute_force_mask(noisy, block, valid):
    """The [x_t ; x_0] rule written out pair by pair."""
    noisy, block, valid = noisy.tolist(), block.tolist(), valid.tolist()

    def allowed(n, b, v, q, k):
        if not v[q]:
            return q == k  # a padding query sees itself only
        if not v[k]:
            return False  # nobody sees padding
        if n[q] and n[k]:
            return b[k] == b[q]  # own noisy block, bidirectional
        if n[q]:
            return b[k] < b[q]  # clean blocks strictly before
        if n[k]:
            return False  # clean never sees noisy
        return b[k] <= b[q]  # clean: block-causal

    T = len(noisy[0])
    return torch.tensor([[[allowed(n, b, v, q, k) for k in range(T)] for q in range(T)]
                         for n, b, v in zip(noisy, block, valid)])


def test_attn_mask_matches_brute_force_on_random_layouts():
    g = torch.Generator().manual_seed(0)
    noisy = torch.rand(3, 20, generator=g) < 0.5
    block = torch.randint(0, 5, (3, 20), generator=g)
    valid = torch.rand(3, 20, generator=g) < 0.85
    assert torch.equal(block_diffusion_attn_mask(noisy, block, valid), brute_force_mask(noisy, block, valid))


@pytest.mark.parametrize("block_length", [4, 8, 32])
def test_batch_mask_matches_brute_force_and_layout(block_length):
    _, b, _ = a_batch(TrainConfig(**TINY, tasks={"sort": 1.0}), block_length=block_length)
    assert torch.equal(b.attn_mask, brute_force_mask(b.noisy, b.block, b.valid))
    # block ids are positions // B; both halves carry absolute positions; x_0 half is the clean text
    assert torch.equal(b.block[b.valid], b.position_ids[b.valid] // block_length)
    clean = b.valid & ~b.noisy
    assert torch.equal(b.input_ids[clean], b.targets[clean])
    for r in range(b.input_ids.shape[0]):
        noisy_pos = b.position_ids[r][b.noisy[r]]
        clean_pos = b.position_ids[r][clean[r]]
        assert torch.equal(clean_pos, torch.arange(clean_pos.numel()))  # clean blocks 0 .. nb-2
        assert noisy_pos[0] % block_length == 0 and torch.equal(noisy_pos, torch.arange(noisy_pos[0], noisy_pos[-1] + 1))
        assert (noisy_pos[-1] + 1) == clean_pos.numel() + block_length  # noisy half ends the canvas


def test_noisy_logits_equal_the_inference_forward():
    """A noisy block's logits in the [x_t ; x_0] forward equal those of the inference pattern:
    clean earlier blocks + the noisy block, block-causal (what decode() forwards)."""
    config = TrainConfig(**TINY, tasks={"add": 1.0}, corrupt_rate=0.3)
    model = build_model(config, TOK).eval()
    _, b, _ = a_batch(config, "add", block_length=4, n=3, seed=1)
    with torch.no_grad():
        logits = model.forward_window(b.input_ids, b.position_ids, b.attn_mask)
        for r in range(3):
            for blk in b.block[r][b.noisy[r]].unique().tolist():
                here = b.noisy[r] & (b.block[r] == blk)
                ctx = b.valid[r] & ~b.noisy[r] & (b.block[r] < blk)
                ids = torch.cat([b.input_ids[r][ctx], b.input_ids[r][here]])[None]
                pos = torch.cat([b.position_ids[r][ctx], b.position_ids[r][here]])[None]
                g = pos[0] // 4
                attn = (g[None, :] <= g[:, None])[None]
                ref = model.forward_window(ids, pos, attn)[0, -int(here.sum()):]
                torch.testing.assert_close(logits[r][here], ref, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- noise


@pytest.mark.parametrize("task_name", ["add", "sort", "sudoku"])
def test_noise_touches_answer_positions_only(task_name):
    config = TrainConfig(**{**TINY, "max_position_embeddings": 256}, tasks={task_name: 1.0}, corrupt_rate=0.3)
    for seed, B in ((0, 4), (1, 32)):
        task, b, cands = a_batch(config, task_name, block_length=B, n=4, seed=seed)
        changed = b.valid & (b.input_ids != b.targets)
        assert not (changed & ~b.answer).any(), "a prompt position was noised"
        assert not (changed & ~b.noisy).any(), "the clean half was noised"
        assert torch.equal(changed, b.masked | b.corrupted)
        assert (b.input_ids[b.masked] == MASK).all()
        assert not (b.masked & b.corrupted).any()
        assert (b.input_ids[b.corrupted] != b.targets[b.corrupted]).all()
        assert torch.isin(b.input_ids[b.corrupted], cands).all()
        assert b.masked.any() and b.corrupted.any()
        # the answer region is the answer, then EOS up to the end of the canvas
        for r in range(b.input_ids.shape[0]):
            tgt = b.targets[r][b.noisy[r] & b.answer[r]].tolist()
            text = TOK.decode([t for t in tgt if t != EOS])
            assert text == task.instances(4, seed, "train")[r].reference and tgt[len(text):] == [EOS] * (len(tgt) - len(text))


def test_corruption_rate_and_candidates():
    config = TrainConfig(**TINY, tasks={"add": 1.0}, corrupt_rate=0.25, mask_rate=(0.0, 0.0001))
    task = get_task("add")
    cands = corruption_candidates(task, TOK, EOS, "answer")
    assert sorted(TOK.decode([c]) for c in cands if c != EOS) == list("0123456789") and EOS in cands.tolist()
    hits = total = 0
    for seed in range(20):
        _, b, _ = a_batch(config, "add", block_length=8, n=16, seed=seed)
        hits += int(b.corrupted.sum())
        total += int((b.noisy & b.answer & ~b.masked).sum())
    assert abs(hits / total - 0.25) < 0.04
    _, b0, _ = a_batch(config.model_copy(update={"corrupt_rate": 0.0}), "add", block_length=8, n=16)
    assert not b0.corrupted.any()


def alternative_batch(config: TrainConfig, task_name: str, seed: int, n: int = 8, block_length: int = 8):
    """A batch whose rows carry another correct answer (as ``train`` builds them), and the rows."""
    rows = training._task_rows(get_task(task_name), TOK, n, seed, alternatives=True)
    task = get_task(task_name)
    cands = corruption_candidates(task, TOK, EOS, config.corrupt_tokens)
    gen = torch.Generator().manual_seed(seed)
    return make_batch(rows, task.answer_length, block_length, MASK, EOS, config, cands, gen), rows


@pytest.mark.parametrize("task_name", ["either", "pick", "tiesort"])
def test_drafting_errors_write_the_other_answer_where_it_differs(task_name):
    config = TrainConfig(**{**TINY, "max_position_embeddings": 256}, tasks={task_name: 1.0}, corrupt_rate=0.2,
                         alternative_rate=0.3, mask_rate=(0.0, 0.5))
    swapped = eligible = 0
    for seed in range(12):
        b, rows = alternative_batch(config, task_name, seed)
        for r, (prompt, answer, alt) in enumerate(rows):
            assert alt is not None and len(alt) == len(answer) and alt != answer
            noisy_answer = b.noisy[r] & b.answer[r]
            written, target = b.input_ids[r][noisy_answer], b.targets[r][noisy_answer]
            other = torch.tensor(alt + [EOS] * (written.numel() - len(alt)))
            unmasked = ~b.masked[r][noisy_answer]
            changed = written != target
            assert torch.equal(changed & unmasked, b.corrupted[r][noisy_answer])  # every change is a corruption
            differs = unmasked & (other != target)
            swapped += int((differs & (written == other)).sum())
            eligible += int(differs.sum())
    # the other answer's token at ~alternative_rate of the positions where it differs (random
    # corruption, drawn after, takes none of them: else ~0.3 * 0.8)
    assert abs(swapped / eligible - 0.3) < 0.035, swapped / eligible


def test_no_alternative_rate_leaves_the_batch_as_before():
    """Rows carrying an alternative change nothing (not even the random draws) at rate 0, and
    tasks with one answer draw none."""
    config = TrainConfig(**{**TINY, "max_position_embeddings": 256}, tasks={"either": 1.0}, corrupt_rate=0.2)
    with_alt, rows = alternative_batch(config, "either", seed=3)
    plain = make_batch([row[:2] for row in rows], get_task("either").answer_length, 8, MASK, EOS, config,
                       corruption_candidates(get_task("either"), TOK, EOS, "answer"), torch.Generator().manual_seed(3))
    assert all(torch.equal(with_alt[k], plain[k]) for k in plain)
    assert all(alt is None for *_, alt in training._task_rows(get_task("add"), TOK, 5, 0, alternatives=True))


def test_canvas_layout_matches_inference():
    x0, P = canvas_tokens([1, 2, 3, 4, 5], [7, 8], answer_length=4, block_length=4, eos_id=0)
    # P + answer_length + 1 = 10 generated-up-to positions -> 3 blocks of 4
    assert P == 5 and x0 == [1, 2, 3, 4, 5, 7, 8, 0, 0, 0, 0, 0]


def test_loss_counts_noised_and_weights_unchanged_positions():
    config = TrainConfig(**TINY, tasks={"add": 1.0}, corrupt_rate=0.2, clean_weight=0.0)
    _, b, _ = a_batch(config, "add", block_length=8, n=8)
    logits = torch.zeros(*b.input_ids.shape, 128)
    logits.scatter_(2, b.targets[..., None], 50.0)  # perfect everywhere
    wrong = b.noisy & b.answer & ~b.masked & ~b.corrupted
    logits[wrong] = 0.0  # bad at unchanged positions only: invisible with clean_weight 0
    assert loss_fn(logits, b, config)[0] < 1e-6
    assert loss_fn(logits, b, config.model_copy(update={"clean_weight": 0.5}))[0] > 1.0


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides, field", [
    ({"lr": -1.0}, "lr"),
    ({"corrupt_rate": 1.5}, "corrupt_rate"),
    ({"alternative_rate": 0.5}, "alternative_rate"),
    ({"block_lengths": [4, 0]}, "block_lengths"),
    ({"mask_rate": [0.8, 0.2]}, "mask_rate"),
    ({"tasks": {"nope": 1.0}}, "tasks"),
    ({"tasks.add": -1.0}, "tasks.add"),
    ({"n_group": 3}, "n_group"),
    ({"stepz": 10}, "stepz"),
    ({"task_params": {"add": {"max_digits": 0}}}, "task_params.add"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_train_config(None, overrides)


def test_yaml_configs_load_and_differ_only_in_corruption(tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "experiments" / "train"
    for stage in ("", "-stage2", "-stage3", "-v2", "-v2b", "-v2c", "-v2d", "-v2e", "-v2f", "-v2g", "-v2h", "-v2i"):  # the testbeds and their v2 continuations
        ed = load_train_config(root / f"editable{stage}.yaml")
        mo = load_train_config(root / f"maskonly{stage}.yaml")
        assert ed.corrupt_rate > 0 and mo.corrupt_rate == 0 and mo.alternative_rate == 0
        assert ed.model_copy(update={"corrupt_rate": 0.0, "alternative_rate": 0.0, "init_from": mo.init_from}) == mo
        assert ed.llada2_config() == load_train_config(root / "editable.yaml").llada2_config()
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1\n")
    with pytest.raises(ConfigError, match="YAML"):
        load_train_config(bad)


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny model on a copy task built from the same machinery (``sort`` of ONE two-digit number:
    ``sort:47=`` -> ``47``), logged to a throwaway SQLite MLflow store. ~300 steps, ~15 s CPU."""
    out = tmp_path_factory.mktemp("run")
    config = TrainConfig(**TINY, tasks={"sort": 1.0}, task_params={"sort": {"min_len": 1, "max_len": 1}},
                         block_lengths=[4, 8], steps=300, batch_tokens=512, lr=5e-3, warmup_steps=10,
                         eval_interval=0, eval_n=8, log_interval=10, corrupt_rate=0.1)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    path = train(config, out / "ckpt", tracking_uri=uri, progress=False)
    return config, path, uri


def test_loss_falls_and_accuracy_beats_chance(trained):
    config, path, _ = trained
    info = json.loads((path / "training.json").read_text())
    losses = [h["loss"] for h in info["history"]]
    assert losses[-1] < 0.2 * losses[0]
    model, tok = load_checkpoint(path)
    task = config.task("sort")
    # per-token accuracy on held-out instances, every answer position masked: chance is 1/10 per digit
    rows = [(tok.encode(i.prompt), tok.encode(i.reference)) for i in task.instances(64, 0, "eval")]
    fully_masked = config.model_copy(update={"mask_rate": (1.0, 1.0), "corrupt_rate": 0.0})
    b = make_batch(rows, task.answer_length, 8, MASK, EOS, fully_masked, torch.tensor([EOS]), torch.Generator())
    with torch.no_grad():
        right = model.forward_window(b.input_ids, b.position_ids, b.attn_mask).argmax(-1) == b.targets
    digits = b.masked & (b.targets != EOS)
    assert right[digits].float().mean() > 0.5
    # and whole answers under the Q preset (at a block length it was trained with)
    policy = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 8})
    res = evaluate(model, tok, task, policy, n=40, seed=0, progress=False)
    assert res.metrics["accuracy"] > max(0.5, 10 * task.chance_score()), res.metrics


def test_checkpoint_round_trip_and_tracking(trained):
    config, path, uri = trained
    saved = json.loads((path / "config.json").read_text())
    assert (saved["mask_token_id"], saved["eos_token_id"]) == (MASK, EOS)
    assert saved["model_type"] == "llada2_moe" and saved["hidden_size"] == 32
    info = json.loads((path / "training.json").read_text())
    assert info["steps"] == 300 and info["wall_time_s"] > 0 and TrainConfig(**info["config"]) == config
    assert (path / "loss_curve.png").stat().st_size > 0
    model, tok = load_checkpoint(path)
    assert (model.mask_token_id, model.eos_token_id) == (MASK, EOS)
    res = evaluate(model, tok, config.task("sort"), "llada2.1-s", n=8, seed=0, progress=False)
    assert res.metrics["n"] == 8 and res.metrics["tpf"] > 0

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dlm-train").experiment_id])
    assert run.data.params["lr"] == "0.005" and run.data.params["tasks.sort"] == "1.0"
    assert run.data.params["block_lengths"] == "[4, 8]"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 30
    assert "eval.sort.accuracy" in run.data.metrics and "eval.sort.tpf" in run.data.metrics
    arts = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")}
    assert {"checkpoint/model.safetensors", "checkpoint/config.json", "checkpoint/loss_curve.png"} <= arts


def test_bfloat16_save_and_cli(tmp_path):
    args = ["train", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "ck"), "--no-progress",
            "--set", "steps=3", "--set", "eval_n=0", "--set", "save_dtype=bfloat16", "--set", "batch_tokens=128"]
    (tmp_path / "cfg.yaml").write_text("\n".join(f"{k}: {v}" for k, v in TINY.items()) + "\ntasks: {add: 1.0}\n")
    assert cli_main(args) == 0
    load_checkpoint(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(tmp_path / "ck" / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.layers.1.attention.dense.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.float32  # router stays fp32
    assert cli_main([*args[:-2], "--set", "corrupt_rate=2"]) == 2
    assert cli_main([*args[:-2], "--set", "bogus"]) == 2


def test_init_from_continues_training_and_checks_the_architecture(trained, tmp_path):
    config, path, _ = trained
    cont = config.model_copy(update={"init_from": str(path), "steps": 2, "eval_n": 0, "lr": 1e-4})
    out = train(cont, tmp_path / "cont", progress=False)
    info = json.loads((out / "training.json").read_text())
    assert info["init_from"]["path"] == str(path) and info["init_from"]["steps"] == 300
    assert info["history"][-1]["loss"] < 0.5  # starts trained (a random init is at ~4.8)
    wider = TrainConfig(**{**TINY, "hidden_size": 48}, tasks={"sort": 1.0}, init_from=str(path), steps=1, eval_n=0)
    with pytest.raises(ConfigError, match="init_from: .*hidden_size"):
        train(wider, tmp_path / "bad", progress=False)
    with pytest.raises(ConfigError, match="init_from"):
        train(cont.model_copy(update={"init_from": str(tmp_path / "missing")}), tmp_path / "bad2", progress=False)


def test_runtime_flags_reach_the_training_run(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text("\n".join(f"{k}: {v}" for k, v in TINY.items()) + "\ntasks: {add: 1.0}\n")
    base = ["train", str(tmp_path / "cfg.yaml"), "--no-progress", "--set", "steps=3", "--set", "eval_n=0",
            "--set", "batch_tokens=128"]
    for bad, field in ((["--device", "cuda:0"], "device"), (["--threads", "0"], "threads"), (["--dtype", "fp8"], "dtype")):
        out = tmp_path / f"bad-{field}"
        assert cli_main([*base, "--out", str(out), *bad]) == 2
        assert field in capsys.readouterr().err
        assert not out.exists(), f"a bad --{field} must write nothing"
    assert cli_main([*base, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16", "--threads", "1"]) == 0
    info = json.loads((tmp_path / "bf16" / "training.json").read_text())
    assert info["config"]["dtype"] == "bfloat16" and info["config"]["threads"] == 1
    assert math.isfinite(info["final_loss_smoothed"])


# ---------------------------------------------------------------------------------------------- resume


def _killed_at(monkeypatch, kill_step):
    """Make ``train`` die at the start of step ``kill_step``, as a killed process would."""
    real = training.lr_at

    def lr_or_die(step, config):
        if step == kill_step:
            raise KeyboardInterrupt("killed")
        return real(step, config)

    monkeypatch.setattr(training, "lr_at", lr_or_die)


def test_a_killed_run_resumes_to_the_same_weights_history_and_mlflow_run(tmp_path, monkeypatch):
    import mlflow

    config = TrainConfig(**TINY, tasks={"add": 1.0, "sort": 1.0}, task_params={"sort": {"min_len": 1, "max_len": 3}},
                         steps=9, batch_tokens=128, warmup_steps=2, block_lengths=[4, 8],
                         eval_n=2, eval_interval=4, log_interval=4, checkpoint_interval=2, seed=5)
    uris = {name: f"sqlite:///{tmp_path / name}.db" for name in ("whole", "cut")}
    whole = train(config, tmp_path / "whole", tracking_uri=uris["whole"], progress=False)
    cut = tmp_path / "cut"
    with monkeypatch.context() as m:
        _killed_at(m, 7)
        with pytest.raises(KeyboardInterrupt):
            train(config, cut, tracking_uri=uris["cut"], progress=False)
    assert json.loads((cut / "resume" / "state.json").read_text())["step"] == 6
    with pytest.raises(ConfigError, match="interrupted run .* step 6 of 9.*--resume"):
        train(config, cut, progress=False)
    with pytest.raises(ConfigError, match=r"resume: .*differs.* lr \(0.002 there, 0.003 here\)"):
        train(config.model_copy(update={"lr": 3e-3}), cut, resume=True, progress=False)
    resumed = train(config.model_copy(update={"threads": 1}), cut, tracking_uri=uris["cut"], progress=False,
                    resume=True)
    assert not (cut / "resume").exists() and not (cut / "resume.tmp").exists()
    a, b = (load_file(p / "model.safetensors") for p in (whole, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # router biases included
    info_a, info_b = (json.loads((p / "training.json").read_text()) for p in (whole, resumed))
    drop = lambda hist: [{k: v for k, v in h.items() if k != "time_s"} for h in hist]  # noqa: E731
    assert drop(info_a["history"]) == drop(info_b["history"]) and info_a["evals"] == info_b["evals"]
    assert [e["step"] for e in info_b["evals"]] == [4, 8, 9]
    runs = {}
    for name, uri in uris.items():
        client = mlflow.MlflowClient(tracking_uri=uri)
        (run,) = client.search_runs([client.get_experiment_by_name("dlm-train").experiment_id])
        runs[name] = [(h.step, h.value) for h in client.get_metric_history(run.info.run_id, "loss")]
    assert runs["cut"] == runs["whole"] and len(runs["whole"]) == 3  # one run, no gap, no duplicate


def test_broken_or_missing_resume_points_get_a_clear_error(tmp_path, monkeypatch):
    config = TrainConfig(**TINY, tasks={"add": 1.0}, steps=5, batch_tokens=128, warmup_steps=1, eval_n=0,
                         checkpoint_interval=2)
    with pytest.raises(ConfigError, match="no resume point"):
        train(config, tmp_path / "never", resume=True, progress=False)
    out = tmp_path / "cut"
    with monkeypatch.context() as m:
        _killed_at(m, 3)
        with pytest.raises(KeyboardInterrupt):
            train(config, out, progress=False)
    (out / "resume").rename(out / "resume.tmp")  # killed between the two moves of the swap
    assert training_resume.find(out) == out / "resume.tmp"
    good = (out / "resume.tmp" / "optimizer.safetensors").read_bytes()
    (out / "resume.tmp" / "optimizer.safetensors").write_bytes(good[:len(good) // 2])
    with pytest.raises(ConfigError, match=r"resume: .*optimizer.safetensors is unreadable.*delete"):
        train(config, out, resume=True, progress=False)
    (out / "resume.tmp" / "optimizer.safetensors").write_bytes(good)
    state = json.loads((out / "resume.tmp" / "state.json").read_text())
    (out / "resume.tmp" / "state.json").write_text(json.dumps({**state, "step": "two"}))
    with pytest.raises(ConfigError, match="state.json is unreadable.*step"):
        train(config, out, resume=True, progress=False)
    (out / "resume.tmp" / "state.json").write_text(json.dumps(state))
    (tmp_path / "c.json").write_text(json.dumps(config.model_dump(mode="json")))
    cmd = ["train", str(tmp_path / "c.json"), "--out", str(out), "--no-progress"]
    assert cli_main(cmd) == 2  # a fresh run would overwrite the resume point
    assert cli_main([*cmd, "--resume"]) == 0
    assert json.loads((out / "training.json").read_text())["history"][-1]["step"] == 5
