"""Train tiny editable block-diffusion LMs (the LLaDA2.1 objective, small scale, CPU).

Read in this order: :class:`~dlm_toolkit.training.config.TrainConfig` (every knob, with ranges),
:mod:`dlm_toolkit.training.objective` (one batch -- canvas layout, noise, the ``[x_t ; x_0]`` input
and its attention mask -- and the loss), then :func:`train` here (model, optimiser, schedule, the
loop, evals, MLflow) and :mod:`dlm_toolkit.training.resume` (resume points).

Output: ``train(config, OUT)`` refuses an ``OUT`` that already holds a checkpoint or any file it
would write, unless ``overwrite=True`` (``dlm train --overwrite``). The final checkpoint is
written to a hidden staging folder inside ``OUT`` and renamed into place file by file only once
all of it is complete, so a kill or a full disk leaves whatever ``OUT`` held before as it was
(a full disk raises :class:`~dlm_toolkit.util.files.NoSpaceError`: exit 2, one line).

MoE routing uses the LLaDA2 / DeepSeek-V3 auxiliary-loss-free balancing: after every step each
router's ``expert_bias`` moves by ``router_bias_rate`` towards equal expert load.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import atomic_write, atomic_write_many, is_disk_full, no_space, write_text
from dlm_toolkit.models.checkpoint import INDEX, SINGLE, remove_stale_weights, save_model
from dlm_toolkit.models.llada2 import LLaDA2MoeModelLM
from dlm_toolkit.tasks import Task
from dlm_toolkit.training.claim import check_destination, checkpoint_bytes, claim
from dlm_toolkit.models.tokenizer import build_char_tokenizer, save_tokenizer, special_ids
from dlm_toolkit.training.config import TrainConfig, load_train_config
from dlm_toolkit.training.objective import (Batch, Row, block_diffusion_attn_mask, canvas_tokens, corruption_candidates,
                                            loss_fn, make_batch, random_other_token)

__all__ = [
    "Batch",
    "TrainConfig",
    "block_diffusion_attn_mask",
    "build_model",
    "canvas_tokens",
    "check_out",
    "corruption_candidates",
    "load_train_config",
    "loss_fn",
    "make_batch",
    "random_other_token",
    "train",
]

# ----------------------------------------------------------------------------------------------
# Model, optimiser, schedule


def build_model(config: TrainConfig, tokenizer: Any) -> LLaDA2MoeModelLM:
    """A seeded random init, or the weights of ``init_from`` (router biases included)."""
    mask_id, eos_id = special_ids(tokenizer)
    cfg = config.llada2_config(len(tokenizer.get_vocab()), mask_id, eos_id)
    model = LLaDA2MoeModelLM(cfg, dtype=torch.float32).init_weights(config.seed)
    if config.init_from is not None:
        from dlm_toolkit.models.checkpoint import CheckpointError, load_model

        try:
            start = load_model(config.init_from)
        except (CheckpointError, OSError) as err:
            raise ConfigError(f"init_from: {err}") from None
        mine, theirs = cfg.model_dump(), start.config.model_dump()
        differ = sorted(k for k in mine if k in theirs and mine[k] != theirs[k])
        if differ:
            raise ConfigError(f"init_from: {config.init_from} has a different architecture ("
                              + ", ".join(f"{k}: {theirs[k]} there, {mine[k]} here" for k in differ) + ")")
        model.load_state_dict(start.state_dict())
    return model


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine down to ``lr * min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(config.steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    floor = config.min_lr_ratio
    return config.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "word_embeddings" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "word_embeddings" not in n)]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.adam_betas)


@torch.no_grad()
def update_router_bias(model: LLaDA2MoeModelLM, trace: dict[str, torch.Tensor], valid: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
    for i, layer in enumerate(model.model.layers):
        idx = trace.get(f"router_topk_idx.{i}")
        if idx is None or rate == 0:
            continue
        load = torch.bincount(idx[valid].flatten(), minlength=model.config.num_experts).float()
        layer.mlp.gate.expert_bias += rate * torch.sign(load.mean() - load)


# ----------------------------------------------------------------------------------------------
# Training loop


def _task_rows(task: Task, tokenizer: Any, n: int, seed: int, alternatives: bool = False) -> list[Row]:
    insts = task.instances(n, seed, "train")
    enc = tokenizer.encode
    rng = random.Random(f"alternative|{seed}")
    rows: list[Row] = []
    for i in insts:
        alt = task.alternative(i, rng) if alternatives else None
        rows.append((enc(i.prompt, add_special_tokens=False), enc(i.reference, add_special_tokens=False),
                     None if alt is None else enc(alt, add_special_tokens=False)))
    return rows


def _row_tokens(prompt_len: int, answer_length: int, B: int) -> int:
    L = -(-(prompt_len + answer_length + 1) // B) * B
    return (L - (prompt_len // B) * B) + (L - B)


def quick_eval(model: LLaDA2MoeModelLM, tokenizer: Any, config: TrainConfig, n: int | None = None) -> dict[str, float]:
    """``{task/accuracy, task/tpf, task/nfe_mean}`` under ``eval_preset`` on ``n`` eval instances per task."""
    from dlm_toolkit.evaluation.evaluate import evaluate

    out: dict[str, float] = {}
    for name in config.tasks:
        res = evaluate(model, tokenizer, config.task(name), config.eval_preset, n or config.eval_n, seed=0,
                       progress=False)
        for key in ("accuracy", "tpf", "nfe_mean"):
            out[f"{name}/{key}"] = float(res.metrics[key])
    return out


def train(config: TrainConfig, out_dir: str | Path, tracking_uri: str | None = None, progress: bool = True,
          resume: bool = False, overwrite: bool = False) -> Path:
    """Train a model with ``config``, save it to ``out_dir`` and return that path.

    ``out_dir`` receives ``config.json`` (with ``mask_token_id``/``eos_token_id``),
    ``model.safetensors``, the tokenizer files, ``training.json`` (config, steps, wall time,
    loss history, evals) and ``loss_curve.png``. With ``tracking_uri`` (e.g.
    ``sqlite:///mlflow.db``) the run is logged to MLflow: flat config as params, loss every
    ``log_interval`` steps, eval accuracy/TPF per task, the checkpoint folder as artifacts.

    Every ``checkpoint_interval`` steps a resume point goes to ``out_dir/resume`` (see
    :mod:`dlm_toolkit.training.resume`); it is removed once the final checkpoint is saved.
    ``resume=True`` continues from it -- same batches, noise and updates as a run that was never
    interrupted, logged to the same MLflow run. Without ``resume`` an existing resume point is
    an error (a fresh run would overwrite it).

    ``out_dir`` must not hold a checkpoint or any file this writes (:func:`check_out`) unless
    ``overwrite`` (or ``resume``: the interrupted run already accepted the folder). Everything
    the run needs is checked before step 1 (:func:`check_before_work`), then the run claims
    ``out`` (:func:`~dlm_toolkit.training.claim.claim`: a second run into it is refused while this
    one lives). Besides that claim's lock file, removed at the end, nothing is created in ``out``
    before the first resume point or the final checkpoint.
    """
    if not isinstance(config, TrainConfig):
        config = load_train_config(config)
    from dlm_toolkit.util.runtime import resolve_device, resolve_threads

    device = resolve_device(config.device)  # before anything is written: a bad device loses nothing
    threads = resolve_threads(config.threads, small_model=True) if config.threads else None
    out = Path(out_dir)
    tokenizer = build_char_tokenizer()
    torch.manual_seed(config.seed)  # before the build: its default init draws from the global generator
    model = build_model(config, tokenizer)  # init_from read and checked here: nothing written yet
    check_before_work(config, tokenizer, out, sum(p.numel() for p in model.parameters()))
    with claim(out):  # one run per folder, from here to the end (a second one is refused at once)
        return _train(config, out, tokenizer, model.to(device), device, threads, tracking_uri, progress, resume,
                      overwrite)


def check_before_work(config: TrainConfig, tokenizer: Any, out: Path, n_params: int) -> None:
    """Everything a run needs later, checked before step 1 so that no mistake surfaces after the
    last step: the eval policy (``eval_preset``, a preset or a policy file) and the canvases of
    training batches and evals against ``max_position_embeddings``, ``out`` (its nearest existing
    ancestor a writable folder) and the free space for the largest write.

    Raises:
        ConfigError: naming the field (``eval_preset``, ``max_position_embeddings``, ``out``).
    """
    from dlm_toolkit.decoding.policy import DecodingPolicy

    try:
        policy = DecodingPolicy(config.eval_preset)
    except (ValueError, TypeError) as err:  # ConfigError is a ValueError
        raise ConfigError(f"eval_preset: {err}") from None
    enc = tokenizer.encode
    block = policy.blocks.block_length
    for name in config.tasks:
        task = config.task(name)
        longest = max(len(enc(i.prompt, add_special_tokens=False)) for i in task.instances(64, config.seed, "train"))
        need = -(-(longest + task.answer_length + 1) // max(config.block_lengths)) * max(config.block_lengths)
        if need > config.max_position_embeddings:
            raise ConfigError(f"max_position_embeddings: task '{name}' needs canvases of {need} positions "
                              f"(got {config.max_position_embeddings})")
        if config.eval_n:
            longest = max(len(enc(i.prompt, add_special_tokens=False)) for i in task.instances(config.eval_n, 0, "eval"))
            need = -(-(longest + task.answer_length + 1) // block) * block
            if need > config.max_position_embeddings:
                raise ConfigError(f"eval_preset: {config.eval_preset!r} decodes task '{name}' in blocks of {block}: "
                                  f"canvases of {need} positions, past max_position_embeddings "
                                  f"{config.max_position_embeddings}")
    check_destination(out, checkpoint_bytes(n_params,
                                            2 if config.save_dtype == "bfloat16" else 4,
                                            0 < config.checkpoint_interval < config.steps))


def _train(config: TrainConfig, out: Path, tokenizer: Any, model: LLaDA2MoeModelLM, device: torch.device, threads: int | None,
           tracking_uri: str | None, progress: bool, resume: bool, overwrite: bool) -> Path:
    """:func:`train` once its inputs are checked and ``out`` is claimed."""
    from tqdm.auto import tqdm

    from dlm_toolkit.training import resume as training_resume

    found = training_resume.find(out)
    point = training_resume.load(found, config.model_dump(mode="json")) if resume and found else None
    if resume and found is None:
        raise ConfigError(f"resume: {out} holds no resume point (OUT/resume/state.json); nothing to continue")
    if found is not None and not resume:
        raise ConfigError(f"out: {out} holds an interrupted run (resume point at step {training_resume.peek_step(found)} "
                          f"of {config.steps}); continue it with --resume, or choose another --out")
    if not resume:
        check_out(out, overwrite)
    if threads:
        torch.set_num_threads(threads)
    rng = random.Random(config.seed)
    gen = torch.Generator().manual_seed(config.seed)

    mask_id, eos_id = special_ids(tokenizer)
    opt = make_optimizer(model, config)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.dtype == "bfloat16")
    names = list(config.tasks)
    weights = [config.tasks[n] for n in names]
    tasks = {n: config.task(n) for n in names}
    cands = {n: corruption_candidates(tasks[n], tokenizer, eos_id, config.corrupt_tokens) for n in names}
    longest = {n: max(len(tokenizer.encode(i.prompt, add_special_tokens=False))
                      for i in tasks[n].instances(64, config.seed, "train")) for n in names}

    mlflow = None
    if tracking_uri:
        import mlflow

        from dlm_toolkit.sweep.mlflow_store import MlflowStore

        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment(experiment_id=MlflowStore(tracking_uri, "dlm-train").experiment_id)  # artifacts by the store
        if point is not None and point.mlflow_run_id and _run_exists(mlflow, point.mlflow_run_id):
            mlflow.start_run(run_id=point.mlflow_run_id)  # the continuation extends the same curves
        else:
            mlflow.start_run(run_name=out.name)
            mlflow.log_params(config.flat())

    history: list[dict[str, float]] = []  # one point per log_interval
    evals: list[dict[str, float]] = []
    window: list[float] = []
    stats_window: dict[str, list[float]] = {}
    first, wall0, cpu0 = 0, 0.0, 0.0
    if point is not None:
        training_resume.restore(point, model, opt, rng, gen)
        first, wall0, cpu0 = point.step, point.wall_s, point.cpu_s
        history, evals, window, stats_window = point.history, point.evals, point.window, point.stats_window
    t_start, cpu_start = time.perf_counter() - wall0, time.process_time() - cpu0
    bar = tqdm(range(first, config.steps), desc="train", disable=not progress, unit="step",
               initial=first, total=config.steps)
    loss_value = float("nan")
    try:
        for step in bar:
            name = rng.choices(names, weights)[0]
            task, B = tasks[name], rng.choice(config.block_lengths)
            n_rows = max(1, min(config.max_batch_rows,
                                config.batch_tokens // _row_tokens(longest[name], task.answer_length, B)))
            rows = _task_rows(task, tokenizer, n_rows, seed=config.seed * 1_000_003 + step,
                              alternatives=config.alternative_rate > 0)
            batch = make_batch(rows, task.answer_length, B, mask_id, eos_id, config, cands[name], gen)
            batch = Batch({k: v.to(device) for k, v in batch.items()})  # noise drawn on the CPU: same on any device

            for group in opt.param_groups:
                group["lr"] = lr_at(step, config)
            with autocast:
                logits, trace = model.forward_window(batch.input_ids, batch.position_ids, batch.attn_mask,
                                                     return_intermediates=True)
            loss, stats = loss_fn(logits.float(), batch, config)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            opt.step()
            update_router_bias(model, trace, batch.valid, config.router_bias_rate)
            del trace, logits

            loss_value = loss.item()
            window.append(loss_value)
            for k, v in stats.items():
                stats_window.setdefault(f"{name}/{k}", []).append(v)
            if (step + 1) % config.log_interval == 0 or step + 1 == config.steps:
                point = {"step": step + 1, "loss": sum(window) / len(window), "lr": lr_at(step, config),
                         "time_s": time.perf_counter() - t_start}
                point.update({k: sum(v) / len(v) for k, v in stats_window.items()})
                history.append(point)
                window, stats_window = [], {}
                bar.set_postfix(loss=f"{point['loss']:.3f}")
                if mlflow is not None:
                    mlflow.log_metrics({k.replace("/", "."): v for k, v in point.items() if k != "step"},
                                       step=step + 1)
            last = step + 1 == config.steps
            if config.eval_n and (last or (config.eval_interval and (step + 1) % config.eval_interval == 0)):
                result = {"step": step + 1, **quick_eval(model, tokenizer, config)}
                evals.append(result)
                bar.write(f"step {step + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in result.items() if k != "step"),
                          file=sys.stderr)
                if mlflow is not None:
                    mlflow.log_metrics({f"eval.{k.replace('/', '.')}": v for k, v in result.items() if k != "step"},
                                       step=step + 1)
            if config.checkpoint_interval and (step + 1) % config.checkpoint_interval == 0 and not last:
                training_resume.save(out, training_resume.ResumePoint(
                    step=step + 1, model=model.state_dict(), optimizer=opt.state_dict(), py_rng=rng.getstate(),
                    noise_rng=gen.get_state(), torch_rng=torch.get_rng_state(), history=history, evals=evals,
                    window=window, stats_window=stats_window, wall_s=time.perf_counter() - t_start,
                    cpu_s=time.process_time() - cpu_start, config=config.model_dump(mode="json"),
                    mlflow_run_id=mlflow.active_run().info.run_id if mlflow is not None else None))
        bar.close()
        wall = time.perf_counter() - t_start
        cpu = time.process_time() - cpu_start
        _save(model, tokenizer, config, out, wall, cpu, loss_value, history, evals)
        training_resume.clear(out)
        if mlflow is not None:
            mlflow.log_metric("wall_time_s", wall)
            mlflow.log_artifacts(str(out), artifact_path="checkpoint")
        return out
    finally:
        if mlflow is not None:
            mlflow.end_run()


def _run_exists(mlflow: Any, run_id: str) -> bool:
    try:
        mlflow.MlflowClient().get_run(run_id)
    except mlflow.exceptions.MlflowException:  # resumed against another tracking store
        return False
    return True


OUTPUT_FILES = ("config.json", SINGLE, INDEX, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "training.json", "loss_curve.png")


def check_out(out: Path, overwrite: bool = False) -> None:
    """Refuse an output folder that holds a checkpoint or any file :func:`train` writes.

    Raises:
        ConfigError: ``out`` is not a folder, or holds such files and ``overwrite`` is False.
    """
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise ConfigError(f"out: {out} exists and is not a folder")
    clash = [name for name in OUTPUT_FILES if (out / name).exists()]
    clash += sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    if clash and not overwrite:
        more = f" and {len(clash) - 4} more" if len(clash) > 4 else ""
        raise ConfigError(f"out: {out} already holds {', '.join(clash[:4])}{more}"
                          f"{' (a checkpoint)' if 'config.json' in clash else ''}; training would replace them. "
                          "Choose another --out, or pass --overwrite to replace them")


def _save(model: LLaDA2MoeModelLM, tokenizer: Any, config: TrainConfig, out: Path, wall: float, cpu: float,
          final_loss: float, history: list[dict], evals: list[dict]) -> None:
    """Write the final checkpoint into a staging folder inside ``out``, then rename every file into
    place at once: until all of it is written, ``out`` keeps what it held (see the module doc)."""
    if config.save_dtype == "bfloat16":
        stored = LLaDA2MoeModelLM(model.config, dtype=torch.bfloat16)  # the router stays float32
        stored.load_state_dict(model.state_dict())
    else:
        stored = model
    info = {
        "config": config.model_dump(mode="json"),
        "steps": config.steps,
        "wall_time_s": round(wall, 1),
        "cpu_time_s": round(cpu, 1),  # the machine is shared: CPU time says what the run cost
        "final_loss": final_loss,
        "final_loss_smoothed": history[-1]["loss"] if history else final_loss,
        "parameters": sum(p.numel() for p in model.parameters()),
        "init_from": _parent(config.init_from),
        "evals": evals,
        "history": history,
    }
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".checkpoint.tmp-", dir=out))
    try:
        try:
            save_model(stored, staging)
            save_tokenizer(tokenizer, staging)
            write_text(staging / "training.json", json.dumps(info, indent=1) + "\n")
            atomic_write(staging / "loss_curve.png", lambda tmp: plot_loss(history, tmp))
        except BaseException as err:
            if is_disk_full(err):  # staging only: nothing in `out` has changed
                raise no_space(out / SINGLE, (out / SINGLE).exists() or (out / INDEX).exists()) from None
            raise
        names = sorted(p.name for p in staging.iterdir() if p.is_file())
        atomic_write_many(out, {name: (lambda tmp, name=name: (staging / name).replace(tmp)) for name in names})
        remove_stale_weights(out, keep=set(names))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _parent(path: str | None) -> dict | None:
    """What a continued run started from: the parent's path and its own training.json summary."""
    if path is None:
        return None
    info_file = Path(path) / "training.json"
    parent = json.loads(info_file.read_text()) if info_file.is_file() else {}
    keep = ("steps", "wall_time_s", "cpu_time_s", "final_loss_smoothed", "config", "init_from")
    return {"path": str(path), **{k: parent[k] for k in keep if k in parent}}


def plot_loss(history: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    try:
        ax.plot([h["step"] for h in history], [h["loss"] for h in history])
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=80, format="png")  # the format by name: a temporary's suffix says nothing
    finally:
        plt.close(fig)
    return path
