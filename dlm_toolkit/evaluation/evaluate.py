"""Evaluate a decoding policy on a task: quality plus speed (NFE, TPF, tokens/s, edits)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from dlm_toolkit.models.chat import encode_prompt, use_chat
from dlm_toolkit.config import ConfigError
from dlm_toolkit.strategy.policy_config import PolicyConfig
from dlm_toolkit.evaluation.generate import generate, strip_eos  # noqa: F401  (strip_eos: re-exported, notebooks use it)
from dlm_toolkit.models.base import DiffusionLM
from dlm_toolkit.models.llada2 import TensorParallel
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.util.runtime import is_small, resolve_device, resolve_dtype, resolve_threads, threads_scope
from dlm_toolkit.step.state import row_seed
from dlm_toolkit.tasks import Task, get_task
from dlm_toolkit.tasks.base import check_prompt_length


@dataclass
class EvalResult:
    """Metrics of one evaluation and one record per instance.

    ``metrics``: ``accuracy`` (mean task score), ``tpf`` (generated tokens up to and including
    EOS, summed, over NFE summed), ``nfe_mean``, ``tokens_per_second`` (generated tokens over
    decode wall time), ``edits_per_token``, ``remasks_per_token``, ``forward_tokens_per_token``
    (positions the model processed per generated token: the compute cost NFE does not show,
    e.g. of multi-block editing), ``inserts_per_token`` / ``deletes_per_token`` (insert/delete
    edits, :mod:`dlm_toolkit.hooks.indel`; 0 for other rules), ``wall_time_s``, ``n``.
    """

    metrics: dict[str, float]
    records: list[dict[str, Any]] = field(default_factory=list)
    chat: bool = False  # prompts went through the checkpoint's chat template

    @property
    def accuracy_interval(self) -> tuple[float, float]:
        """95 % Wilson interval of the accuracy (see :mod:`dlm_toolkit.evaluation.stats`)."""
        from dlm_toolkit.evaluation.stats import wilson

        return wilson(sum(r["score"] for r in self.records), len(self.records))

    def outcomes(self) -> list[dict[str, Any]]:
        """Per-instance outcomes in instance order: ``score``, ``nfe``, ``tokens``, ``edits``."""
        return [{k: r[k] for k in ("score", "nfe", "tokens", "edits")} for r in self.records]


def evaluate(
    model: DiffusionLM,
    tokenizer: Any,
    task: Task | str,
    policy: DecodingPolicy | PolicyConfig | str | dict | None,
    n: int,
    seed: int = 0,
    *,
    batch_size: int = 32,
    kv_cache: bool = True,
    progress: bool = True,
    on_batch: Callable[[int, dict[str, float]], None] | None = None,
    threads: int | None = None,
    cuda_graphs: bool | None = None,
) -> EvalResult:
    """Decode ``n`` held-out (eval-split) instances of ``task`` and score them.

    Args:
        model: any DiffusionLM; ``tokenizer`` must be the one it was trained with.
        task: a :class:`Task` or a task name.
        n: number of eval instances (seeded by ``seed``).
        batch_size: prompts decoded together. Rows are independent and instance i draws its
            random numbers from the stream ``row_seed(seed, i)``, so results do not depend on it,
            at any temperature.
        on_batch: called after each batch with (instances done, running metrics); sweeps use
            it to report intermediate quality for pruning.
        threads: intra-op CPU threads while evaluating (default: 1 for a small model, torch's
            default for a large one); restored afterwards.
        cuda_graphs: as :func:`~dlm_toolkit.decoding.loop.decode`'s (``None``: on for a CUDA model).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(f"n: must be an integer >= 1 (got {n!r})")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError(f"batch_size: must be an integer >= 1 (got {batch_size!r})")
    with threads_scope(resolve_threads(threads, small_model=is_small(model))):
        return _evaluate(model, tokenizer, task, policy, n, seed, batch_size, kv_cache, progress, on_batch,
                         cuda_graphs)


def _evaluate(model: DiffusionLM, tokenizer: Any, task: Task | str, policy: Any, n: int, seed: int, batch_size: int,
              kv_cache: bool, progress: bool, on_batch: Callable[[int, dict[str, float]], None] | None,
              cuda_graphs: bool | None = None) -> EvalResult:
    task = get_task(task) if isinstance(task, str) else task
    check_n(task, n)
    if hasattr(model, "check_task"):  # a model of one task (an oracle) refuses the others
        model.check_task(task)
    policy = policy if isinstance(policy, DecodingPolicy) else DecodingPolicy(policy)
    instances = task.instances(n, seed, "eval")
    chat = use_chat(tokenizer, task.chat, f"task '{task.name}': chat")
    prompts = [task_prompt(tokenizer, task, inst, chat) for inst in instances]
    gen_length = task.answer_length + 1  # room for the EOS
    check_task_context(model, max(len(p) for p in prompts) + gen_length, policy, task.name)
    records: list[dict[str, Any]] = []
    totals = {"tokens": 0, "nfe": 0, "edits": 0, "remasks": 0, "forward_tokens": 0, "inserts": 0, "deletes": 0,
              "score": 0.0, "wall": 0.0}
    bar = tqdm(total=n, desc=f"eval {task.name}", disable=not progress, unit="inst")
    for start in range(0, n, batch_size):
        batch = instances[start : start + batch_size]
        streams = [row_seed(seed, i) for i in range(start, start + len(batch))]
        rows, wall = generate(model, tokenizer, prompts[start : start + batch_size], policy, gen_length,
                              stop=task.stop, seeds=streams, kv_cache=kv_cache,
                              cuda_graphs=cuda_graphs)
        totals["wall"] += wall
        scores = task.score_batch(batch, [g.text for g in rows])
        for inst, score, row in zip(batch, scores, rows):
            records.append({"prompt": inst.prompt, "reference": inst.reference, "completion": row.text,
                            "score": score, "nfe": row.nfe, "tokens": len(row.tokens), "edits": row.edits,
                            "stopped": row.stopped})
            totals["tokens"] += len(row.tokens)
            totals["nfe"] += row.nfe
            totals["edits"] += row.edits
            totals["remasks"] += row.remasks
            totals["forward_tokens"] += row.forward_tokens
            totals["inserts"] += row.inserts
            totals["deletes"] += row.deletes
            totals["score"] += score
        running = metrics_from(totals, len(records))
        bar.update(len(batch))
        bar.set_postfix(acc=f"{running['accuracy']:.3f}", tpf=f"{running['tpf']:.2f}")
        if on_batch is not None:
            on_batch(len(records), running)
    bar.close()
    metrics = metrics_from(totals, len(records))
    extra = getattr(task, "extra_metrics", None)  # per-group scores (livecodebench: per difficulty/platform)
    if extra is not None:
        metrics.update(extra(instances, [r["score"] for r in records], [r["completion"] for r in records]))
    return EvalResult(metrics, records, chat=chat)


def task_prompt(tokenizer: Any, task: Task, instance: Any, chat: bool) -> list[int]:
    """The ids an instance is decoded from: its raw prompt, or (``chat``) its user message (after
    the task's system turn, if any) through the tokenizer's chat template. A text past
    :data:`~dlm_toolkit.tasks.base.MAX_PROMPT_CHARS` is refused before the tokenizer sees it."""
    ident = next((instance.meta[k] for k in ("task_id", "question_id", "index") if k in instance.meta), None)
    check_prompt_length(instance.prompt if not chat else task.user_message(instance),
                        f"task '{task.name}'" + (f", instance {ident}" if ident is not None else ""))
    if not chat:
        return encode_prompt(tokenizer, instance.prompt, False)
    return encode_prompt(tokenizer, task.user_message(instance), True, task.system,
                         messages=task.chat_messages(instance))


MAX_GENERATED_N = 100_000  # instances of a generated task one evaluation may decode


def check_n(task: Task, n: int, *, split: bool = True) -> None:
    """Refuse ``n`` beyond the task's eval split (HumanEval has 164 problems, no more), or, for a
    generated task (no fixed split), beyond :data:`MAX_GENERATED_N`. ``split=False`` (sweep
    experiments, where ``n`` beyond the split means the whole split) checks only the latter."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"n: must be an integer >= 1, got {n!r}")
    if split and task.eval_size is not None and n > task.eval_size:
        raise ConfigError(f"n: {n} is more than the {task.eval_size} eval instances task '{task.name}' has")
    if task.eval_size is None and n > MAX_GENERATED_N:
        raise ConfigError(f"n: {n} is more than {MAX_GENERATED_N}, the most instances of generated task "
                          f"'{task.name}' one evaluation decodes")


def metrics_from(totals: dict[str, float], n: int) -> dict[str, float]:
    tokens = max(totals["tokens"], 1)
    return {
        "accuracy": totals["score"] / n,
        "tpf": totals["tokens"] / max(totals["nfe"], 1),
        "nfe_mean": totals["nfe"] / n,
        "tokens_per_second": totals["tokens"] / totals["wall"] if totals["wall"] > 0 else 0.0,
        "edits_per_token": totals["edits"] / tokens,
        "remasks_per_token": totals["remasks"] / tokens,
        "forward_tokens_per_token": totals["forward_tokens"] / tokens,
        "inserts_per_token": totals["inserts"] / tokens,
        "deletes_per_token": totals["deletes"] / tokens,
        "wall_time_s": totals["wall"],
        "n": n,
    }


def check_task_context(model: DiffusionLM, needed: int, policy: DecodingPolicy, task: str) -> None:
    """Refuse a task whose prompt + answer (rounded up to whole blocks) exceeds the model's context.

    Evaluations (``dlm eval``, sweeps, lm-eval) never decode past it, so the message names what
    they do accept instead of :func:`check_context`'s ``--allow-past-context`` (``dlm decode`` only)."""
    block = policy.blocks.block_length
    canvas = -(-needed // block) * block
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and canvas > limit:
        raise ConfigError(
            f"task '{task}' needs a canvas of {canvas} positions (prompt + answer, whole blocks of {block}) but the "
            f"model's context is {limit} (max_position_embeddings); an evaluation does not decode past the context: "
            "shorten the prompt or --gen-length (only `dlm decode --allow-past-context` decodes past it)")


def load_checkpoint(path: str | Path, need_tokenizer: bool = True, *, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, mask_token_id: int | None = None,
                    eos_token_id: int | None = None, tp: TensorParallel | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a checkpoint folder; a clear error if the tokenizer is missing.

    ``device``: ``cpu`` (default), ``cuda``, ``cuda:N``; ``dtype``: the weights' dtype (default
    float32 on the CPU, bfloat16 on a GPU); see :mod:`dlm_toolkit.util.runtime`. ``mask_token_id`` /
    ``eos_token_id`` override the special ids (default: config.json, else the tokenizer).
    ``tp``: a :class:`~dlm_toolkit.models.llada2.TensorParallel` rank to load only its shard
    (what :func:`dlm_toolkit.models.distributed.init_from_env` returns under ``torchrun``).
    """
    from dlm_toolkit.models import load_model
    from dlm_toolkit.models.tokenizer import find_tokenizer

    dev = resolve_device(device)
    if str(path).startswith("oracle:"):  # an exact model of a list task (dlm_toolkit.models.oracle)
        from dlm_toolkit.models.oracle import load_oracle

        return load_oracle(str(path), resolve_dtype(dtype, dev), dev)
    model = load_model(path, dtype=resolve_dtype(dtype, dev), device=dev, mask_token_id=mask_token_id,
                       eos_token_id=eos_token_id, tp=tp)
    tokenizer = find_tokenizer(path)
    if tokenizer is None and need_tokenizer:
        raise ConfigError(f"{path}: no tokenizer files (tokenizer.json) in the checkpoint; evaluation needs one")
    return model, tokenizer
