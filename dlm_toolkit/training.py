"""Train tiny editable block-diffusion LMs (the LLaDA2.1 objective, small scale, CPU).

Read in this order: :class:`TrainConfig` (every knob, with ranges), :func:`make_batch` (one
training batch: canvas layout, noise, the ``[x_t ; x_0]`` input and its attention mask),
:func:`block_diffusion_attn_mask` (the mask rule), :func:`loss_fn`, then :func:`train`.

The objective
-------------
A training row is laid out exactly like an inference canvas: ``prompt ++ answer ++ EOS ...``
up to the end of the block that holds position ``P + answer_length`` (the last of the
``answer_length + 1`` generated positions ``evaluate()`` asks for), blocks of ``B`` aligned at
absolute position 0. ``B`` is drawn per step from ``block_lengths`` so one model serves every
block length the sweeps use.

Noise (answer and EOS-padding positions only, never the prompt): each block ``b`` draws
``t_b ~ U(mask_rate)``; each of its answer positions becomes the mask token with probability
``t_b``; each remaining answer position is replaced, with probability ``corrupt_rate``, by a
random token different from the original (``corrupt_tokens``: ``answer`` = the task's answer
alphabet plus EOS, i.e. the confusions a model actually makes -- wrong digits, a wrong comma,
a premature or missing EOS; ``printable`` = any printable character plus EOS).

Drafting errors (``alternative_rate``): on tasks with several correct answers
(:meth:`~dlm_toolkit.tasks.base.Task.alternative`) each row also draws another correct answer, and
each unmasked answer position where the two differ takes the other answer's token with
probability ``alternative_rate`` (before the random corruption, which then skips it). That is the
error parallel commits make -- every position plausible alone, the whole a mix of two answers --
and random tokens almost never produce it. The target stays the row's answer, which (the rate
being below one half) is what most of the written coupled positions agree with, so the model
learns to edit the minority of a mix towards the majority.

Input: the BD3-LM formulation. The noisy canvas ``x_t`` and the clean canvas ``x_0`` are fed
as one sequence ``[x_t ; x_0]`` with the same absolute position ids in both halves, under a
boolean attention mask (query may attend key):

* noisy block b -> noisy block b (bidirectional) and clean blocks ``< b``;
* clean block b -> clean blocks ``<= b`` (block-causal, as at inference).

So every noisy block sees exactly what the active block sees at inference: itself plus the
finished blocks before it (teacher-forced with the clean text). Two exact savings: noisy
blocks that hold no answer position are dropped (nothing to learn there) and so is the last
clean block (no noisy block may see it). Logits are read from the noisy half only.

Loss: cross-entropy of the ORIGINAL token at masked positions and at corrupted positions
(weight 1; ``loss_weighting: inverse_t`` multiplies masked positions by ``1 / t_b``, the
ELBO weight; ``uniform`` -- the default -- does not, which has lower variance), normalised by
their count, plus ``clean_weight`` times the mean cross-entropy at unchanged answer positions.
That last term matters for T2T editing: the S preset edits wherever the argmax differs from
the written token (editing threshold 0.0), so the model must also learn to reproduce correct
tokens -- without it their argmax is untrained. The mask-only ablation keeps the same term
(only ``corrupt_rate`` and ``alternative_rate`` differ), so the comparison isolates the
corruption noise.

MoE routing uses the LLaDA2 / DeepSeek-V3 auxiliary-loss-free balancing: after every step each
router's ``expert_bias`` moves by ``router_bias_rate`` towards equal expert load.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dlm_toolkit.config import ConfigError, flatten, read_mapping_file, set_dotted, validate_model
from dlm_toolkit.models.checkpoint import save_model
from dlm_toolkit.models.llada2 import LLaDA2Config, LLaDA2MoeModelLM
from dlm_toolkit.tasks import TASKS, Task, get_task
from dlm_toolkit.tokenizer import build_char_tokenizer, save_tokenizer, special_ids

__all__ = [
    "Batch",
    "TrainConfig",
    "block_diffusion_attn_mask",
    "build_model",
    "load_train_config",
    "loss_fn",
    "make_batch",
    "train",
]

Rate = Annotated[float, Field(ge=0.0, le=1.0)]

# ----------------------------------------------------------------------------------------------
# Config


class TrainConfig(BaseModel):
    """Everything a training run depends on (frozen; unknown keys rejected; ranges on every field).

    Load from YAML with :func:`load_train_config`. Flat keys (``tasks.add``) work with ``--set``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # -- model (LLaDA2 MoE fields; see :class:`~dlm_toolkit.models.llada2.LLaDA2Config`)
    hidden_size: int = Field(128, ge=16, le=2048)
    num_hidden_layers: int = Field(4, ge=1, le=48)
    num_attention_heads: int = Field(4, ge=1, le=64)
    num_key_value_heads: int = Field(2, ge=1, le=64)
    head_dim: int = Field(32, ge=8, le=256)
    intermediate_size: int = Field(512, ge=8, le=16384, description="dense MLP width (first layers)")
    moe_intermediate_size: int = Field(128, ge=8, le=8192, description="width of each expert")
    num_experts: int = Field(8, ge=2, le=256)
    num_experts_per_tok: int = Field(2, ge=1, le=16)
    num_shared_experts: int = Field(1, ge=0, le=4)
    n_group: int = Field(4, ge=1, le=64)
    topk_group: int = Field(2, ge=1, le=64)
    first_k_dense_replace: int = Field(1, ge=0, le=48)
    routed_scaling_factor: float = Field(2.5, gt=0.0, le=100.0)
    rope_theta: float = Field(600000.0, gt=0.0, le=1e9)
    max_position_embeddings: int = Field(256, ge=16, le=65536)
    initializer_range: float = Field(0.02, gt=0.0, le=1.0)

    # -- data
    tasks: dict[str, Annotated[float, Field(gt=0.0, le=1000.0)]] = Field(
        default_factory=lambda: {"add": 1.0, "sort": 1.0, "sudoku": 1.0},
        description="task name -> mixture weight (probability a step draws its batch from it)")
    task_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="task name -> constructor kwargs, e.g. {add: {max_digits: 2}}")
    block_lengths: list[Annotated[int, Field(ge=1, le=256)]] = Field(
        default_factory=lambda: [4, 8, 16, 32], min_length=1, description="one is drawn per step")

    # -- noise and loss
    mask_rate: tuple[Rate, Rate] = Field((0.0, 1.0), description="t ~ U(lo, hi) per block")
    corrupt_rate: float = Field(0.1, ge=0.0, le=0.9, description="P(unmasked answer position -> random token)")
    corrupt_tokens: Literal["answer", "printable"] = "answer"
    alternative_rate: float = Field(0.0, ge=0.0, lt=0.5, description=(
        "P(unmasked answer position where another correct answer differs -> that answer's token); "
        "below 0.5 so the written answer stays the majority"))
    clean_weight: float = Field(0.1, ge=0.0, le=10.0, description="loss weight of unchanged answer positions")
    loss_weighting: Literal["uniform", "inverse_t"] = "uniform"

    # -- optimisation
    steps: int = Field(2000, ge=1, le=10_000_000)
    batch_tokens: int = Field(4096, ge=16, le=10_000_000,
                              description="batch size in [x_t; x_0] tokens: rows = batch_tokens // row length")
    max_batch_rows: int = Field(256, ge=1, le=100_000)
    lr: float = Field(2e-3, gt=0.0, le=1.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine decays to lr * min_lr_ratio")
    warmup_steps: int = Field(100, ge=0, le=1_000_000)
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="max grad norm; 0 disables clipping")
    adam_betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.98)
    router_bias_rate: float = Field(1e-3, ge=0.0, le=1.0, description="aux-loss-free balancing step")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    init_from: str | None = Field(None, description="checkpoint folder to start from (continued training); "
                                                    "its architecture must equal the model fields above")
    threads: int = Field(1, ge=0, le=256, description="torch.set_num_threads; 0 leaves it alone")
    device: str = Field("cpu", min_length=1, description="cpu, cuda or cuda:N (checked against this machine)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype: bfloat16 runs forwards under autocast (weights and optimiser stay float32)")

    # -- evaluation, logging, saving
    eval_interval: int = Field(500, ge=0, le=10_000_000, description="steps between quick evals; 0 = only at the end")
    eval_n: int = Field(50, ge=0, le=100_000, description="eval instances per task (0 disables evals)")
    eval_preset: str = Field("llada2.1-q", min_length=1)
    log_interval: int = Field(10, ge=1, le=100_000, description="steps per logged loss point")
    save_dtype: Literal["float32", "bfloat16"] = "float32"
    checkpoint_interval: int = Field(500, ge=0, le=10_000_000,
                                     description="steps between resume points in OUT/resume (0 = none)")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        unknown = sorted(set(self.tasks) - set(TASKS))
        if unknown:
            raise ValueError(f"tasks: unknown task(s) {unknown}; available: {sorted(TASKS)}")
        stray = sorted(set(self.task_params) - set(self.tasks))
        if stray:
            raise ValueError(f"task_params: {stray} are not in tasks {sorted(self.tasks)}")
        lo, hi = self.mask_rate
        if lo > hi or hi == 0.0:
            raise ValueError(f"mask_rate: need 0 <= lo <= hi <= 1 and hi > 0, got {list(self.mask_rate)}")
        try:
            self.llada2_config()
        except ValidationError as err:  # the model's own consistency checks, e.g. "n_group: must divide ..."
            first = err.errors()[0]
            raise ValueError(str(first.get("ctx", {}).get("error", first["msg"]))) from None
        for name in self.tasks:
            try:
                self.task(name)
            except (TypeError, ValueError) as err:
                raise ValueError(f"task_params.{name}: {err}") from None
        return self

    def task(self, name: str) -> Task:
        return get_task(name, **self.task_params.get(name, {}))

    def llada2_config(self, vocab_size: int = 128, mask_token_id: int | None = None,
                      eos_token_id: int | None = None) -> LLaDA2Config:
        return LLaDA2Config(
            vocab_size=vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, num_shared_experts=self.num_shared_experts,
            n_group=self.n_group, topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
            first_k_dense_replace=self.first_k_dense_replace, rms_norm_eps=1e-6, rope_theta=self.rope_theta,
            partial_rotary_factor=0.5, max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
        )

    def flat(self) -> dict[str, Any]:
        """Flat dotted keys (``tasks.add``) -> values; lists/tuples as JSON strings (MLflow params)."""
        out = flatten(self.model_dump(mode="json"))
        return {k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in out.items()}


def load_train_config(source: str | Path | Mapping[str, Any] | None = None,
                      overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """A validated :class:`TrainConfig` from a YAML/JSON file or a dict, plus flat-key overrides
    (``{"steps": 100, "tasks.add": 2.0}``). Raises :class:`ConfigError` naming the field."""
    if source is None:
        data: dict[str, Any] = {}
    elif isinstance(source, Mapping):
        data = json.loads(json.dumps(dict(source)))
    else:
        data = read_mapping_file(source)
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    return validate_model(TrainConfig, data)


# ----------------------------------------------------------------------------------------------
# Batches: layout, noise, the [x_t ; x_0] input


def block_diffusion_attn_mask(noisy: torch.Tensor, block: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(R, T, T)`` bool attention mask of a ``[x_t ; x_0]`` row (query t may attend key s).

    Args (all ``(R, T)``): ``noisy`` True for tokens of the noisy half, ``block`` each token's
    block index (absolute position // B), ``valid`` False for row padding.

    Noisy block b sees noisy block b and clean blocks < b; clean block b sees clean blocks <= b.
    Padding queries see only themselves (no NaN from an empty softmax) and no one sees padding.
    """
    qn, kn = noisy[:, :, None], noisy[:, None, :]
    qb, kb = block[:, :, None], block[:, None, :]
    allowed = (qn & kn & (kb == qb)) | (qn & ~kn & (kb < qb)) | (~qn & ~kn & (kb <= qb))
    allowed = allowed & valid[:, :, None] & valid[:, None, :]
    eye = torch.eye(noisy.shape[1], dtype=torch.bool, device=noisy.device)
    return allowed | (eye & ~valid[:, :, None])


Row = tuple[list[int], ...]  # (prompt_ids, answer_ids) or (prompt_ids, answer_ids, alternative_ids | None)


class Batch(dict):
    """Tensors of one training batch (a dict with attribute access), all ``(R, T)``:

    ``input_ids``, ``position_ids``, ``attn_mask`` (R, T, T), ``targets`` (original tokens),
    ``noisy`` (token in the x_t half), ``block``, ``valid`` (not row padding), ``answer``
    (a generated position: answer or EOS padding), ``masked``, ``corrupted``, ``t`` (the mask
    rate of the token's block), ``clean_ids`` (the token in x_0 at the same position).
    """

    __getattr__ = dict.__getitem__


def canvas_tokens(prompt_ids: list[int], answer_ids: list[int], answer_length: int, block_length: int,
                  eos_id: int) -> tuple[list[int], int]:
    """``(x_0, P)``: prompt ++ answer ++ EOS up to the end of the block holding position
    ``P + answer_length`` -- the canvas ``evaluate()`` decodes for ``gen_length = answer_length + 1``."""
    P = len(prompt_ids)
    if len(answer_ids) > answer_length:
        raise ValueError(f"answer of {len(answer_ids)} tokens exceeds answer_length={answer_length}")
    length = -(-(P + answer_length + 1) // block_length) * block_length
    return prompt_ids + answer_ids + [eos_id] * (length - P - len(answer_ids)), P


def corruption_candidates(task: Task, tokenizer: Any, eos_id: int, kind: str) -> torch.Tensor:
    """Token ids random corruptions are drawn from (see the module docstring)."""
    if kind == "answer":
        chars = sorted(set(task.answer_alphabet))
    else:
        chars = [chr(c) for c in range(0x20, 0x7F)]
    ids = sorted({tokenizer.convert_tokens_to_ids(ch) for ch in chars} | {eos_id})
    return torch.tensor(ids, dtype=torch.long)


def random_other_token(original: torch.Tensor, candidates: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A token drawn uniformly from ``candidates`` minus ``original`` (elementwise)."""
    K = candidates.numel()
    hit = candidates[None, :] == original.reshape(-1, 1)  # (N, K)
    present = hit.any(1)
    where = hit.float().argmax(1)  # index of the original among the candidates (if present)
    n_choices = K - present.long()
    j = (torch.rand(original.numel(), generator=gen) * n_choices).long().clamp(max=K - 1)
    j = j + (present & (j >= where)).long()  # skip the original
    return candidates[j].reshape(original.shape)


def make_batch(rows: list[Row], answer_length: int, block_length: int, mask_id: int,
               eos_id: int, config: TrainConfig, candidates: torch.Tensor, gen: torch.Generator) -> Batch:
    """One batch from ``(prompt_ids, answer_ids[, alternative_ids])`` rows: canvas, noise,
    ``[x_t ; x_0]``, mask (``alternative_ids``: another correct answer of the same length, or None).

    Each row keeps the noisy blocks that hold answer positions and the clean blocks before the
    last one, then rows are right-padded to a common length (``valid`` marks real tokens).
    """
    B = block_length
    lo_rate, hi_rate = config.mask_rate
    out: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "input_ids", "position_ids", "targets", "noisy", "block", "answer", "masked", "corrupted", "t", "clean_ids")}
    for prompt_ids, answer_ids, *alt in rows:
        x0, P = canvas_tokens(prompt_ids, answer_ids, answer_length, B, eos_id)
        x0 = torch.tensor(x0, dtype=torch.long)
        L = x0.numel()
        pos = torch.arange(L)
        blk = pos // B
        answer = pos >= P
        t = lo_rate + (hi_rate - lo_rate) * torch.rand(L // B, generator=gen)  # per block
        t_pos = t[blk]
        masked = answer & (torch.rand(L, generator=gen) < t_pos)
        swapped = torch.zeros(L, dtype=torch.bool)
        if config.alternative_rate > 0 and alt and alt[0] is not None:
            x_alt = torch.tensor(canvas_tokens(prompt_ids, alt[0], answer_length, B, eos_id)[0], dtype=torch.long)
            swapped = answer & ~masked & (x_alt != x0) & (torch.rand(L, generator=gen) < config.alternative_rate)
        randomised = answer & ~masked & ~swapped & (torch.rand(L, generator=gen) < config.corrupt_rate)
        corrupted = swapped | randomised
        xt = x0.clone()
        xt[masked] = mask_id
        if swapped.any():
            xt[swapped] = x_alt[swapped]
        if randomised.any():
            xt[randomised] = random_other_token(x0[randomised], candidates, gen)
        keep_noisy = blk >= P // B  # blocks holding answer positions
        keep_clean = blk < L // B - 1  # the last clean block is never attended
        n, c = keep_noisy, keep_clean
        out["input_ids"].append(torch.cat([xt[n], x0[c]]))
        out["position_ids"].append(torch.cat([pos[n], pos[c]]))
        out["targets"].append(torch.cat([x0[n], x0[c]]))
        out["noisy"].append(torch.cat([torch.ones(int(n.sum()), dtype=torch.bool), torch.zeros(int(c.sum()), dtype=torch.bool)]))
        out["block"].append(torch.cat([blk[n], blk[c]]))
        out["answer"].append(torch.cat([answer[n], answer[c]]))
        out["masked"].append(torch.cat([masked[n], torch.zeros(int(c.sum()), dtype=torch.bool)]))
        out["corrupted"].append(torch.cat([corrupted[n], torch.zeros(int(c.sum()), dtype=torch.bool)]))
        out["t"].append(torch.cat([t_pos[n], torch.zeros(int(c.sum()))]))
        out["clean_ids"].append(torch.cat([x0[n], x0[c]]))
    T = max(x.numel() for x in out["input_ids"])

    def pad(xs: list[torch.Tensor], value) -> torch.Tensor:
        return torch.stack([F.pad(x, (0, T - x.numel()), value=value) for x in xs])

    batch = Batch(
        input_ids=pad(out["input_ids"], eos_id), position_ids=pad(out["position_ids"], 0),
        targets=pad(out["targets"], eos_id), noisy=pad(out["noisy"], False), block=pad(out["block"], 0),
        answer=pad(out["answer"], False), masked=pad(out["masked"], False),
        corrupted=pad(out["corrupted"], False), t=pad(out["t"], 0.0), clean_ids=pad(out["clean_ids"], eos_id),
        valid=pad([torch.ones(x.numel(), dtype=torch.bool) for x in out["input_ids"]], False),
    )
    batch["attn_mask"] = block_diffusion_attn_mask(batch.noisy, batch.block, batch.valid)
    return batch


def loss_fn(logits: torch.Tensor, batch: Batch, config: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of the module docstring and a few diagnostics (token accuracy at noised positions)."""
    noised = batch.noisy & (batch.masked | batch.corrupted)
    unchanged = batch.noisy & batch.answer & ~batch.masked & ~batch.corrupted
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1), reduction="none")
    ce = ce.view_as(batch.targets)
    w = noised.float()
    if config.loss_weighting == "inverse_t":
        w = torch.where(batch.masked, 1.0 / batch.t.clamp(min=1e-3), w)
    loss = (ce * w).sum() / noised.sum().clamp(min=1)
    if config.clean_weight > 0:
        loss = loss + config.clean_weight * (ce * unchanged).sum() / unchanged.sum().clamp(min=1)
    with torch.no_grad():
        right = logits.argmax(-1) == batch.targets
        stats = {
            "masked_acc": float((right & batch.masked).sum() / batch.masked.sum().clamp(min=1)),
            "corrupt_acc": float((right & batch.corrupted).sum() / batch.corrupted.sum().clamp(min=1)),
            "keep_acc": float((right & unchanged).sum() / unchanged.sum().clamp(min=1)),
        }
    return loss, stats


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
    from dlm_toolkit.evaluate import evaluate

    out: dict[str, float] = {}
    for name in config.tasks:
        res = evaluate(model, tokenizer, config.task(name), config.eval_preset, n or config.eval_n, seed=0,
                       progress=False)
        for key in ("accuracy", "tpf", "nfe_mean"):
            out[f"{name}/{key}"] = float(res.metrics[key])
    return out


def train(config: TrainConfig, out_dir: str | Path, tracking_uri: str | None = None, progress: bool = True,
          resume: bool = False) -> Path:
    """Train a model with ``config``, save it to ``out_dir`` and return that path.

    ``out_dir`` receives ``config.json`` (with ``mask_token_id``/``eos_token_id``),
    ``model.safetensors``, the tokenizer files, ``training.json`` (config, steps, wall time,
    loss history, evals) and ``loss_curve.png``. With ``tracking_uri`` (e.g.
    ``sqlite:///mlflow.db``) the run is logged to MLflow: flat config as params, loss every
    ``log_interval`` steps, eval accuracy/TPF per task, the checkpoint folder as artifacts.

    Every ``checkpoint_interval`` steps a resume point goes to ``out_dir/resume`` (see
    :mod:`dlm_toolkit.training_resume`); it is removed once the final checkpoint is saved.
    ``resume=True`` continues from it -- same batches, noise and updates as a run that was never
    interrupted, logged to the same MLflow run. Without ``resume`` an existing resume point is
    an error (a fresh run would overwrite it).
    """
    from tqdm.auto import tqdm

    if not isinstance(config, TrainConfig):
        config = load_train_config(config)
    from dlm_toolkit.runtime import resolve_device

    from dlm_toolkit import training_resume

    device = resolve_device(config.device)  # before anything is written: a bad device loses nothing
    out = Path(out_dir)
    found = training_resume.find(out)
    point = training_resume.load(found, config.model_dump(mode="json")) if resume and found else None
    if resume and found is None:
        raise ConfigError(f"resume: {out} holds no resume point (OUT/resume/state.json); nothing to continue")
    if found is not None and not resume:
        step = json.loads((found / "state.json").read_text()).get("step", "?")
        raise ConfigError(f"out: {out} holds an interrupted run (resume point at step {step} of {config.steps}); "
                          "continue it with --resume, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    gen = torch.Generator().manual_seed(config.seed)

    tokenizer = build_char_tokenizer()
    mask_id, eos_id = special_ids(tokenizer)
    model = build_model(config, tokenizer).to(device)
    opt = make_optimizer(model, config)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.dtype == "bfloat16")
    names = list(config.tasks)
    weights = [config.tasks[n] for n in names]
    tasks = {n: config.task(n) for n in names}
    cands = {n: corruption_candidates(tasks[n], tokenizer, eos_id, config.corrupt_tokens) for n in names}
    longest = {n: max(len(tokenizer.encode(i.prompt, add_special_tokens=False))
                      for i in tasks[n].instances(64, config.seed, "train")) for n in names}
    for n in names:
        need = -(-(longest[n] + tasks[n].answer_length + 1) // max(config.block_lengths)) * max(config.block_lengths)
        if need > config.max_position_embeddings:
            raise ConfigError(f"max_position_embeddings: task '{n}' needs canvases of {need} positions "
                              f"(got {config.max_position_embeddings})")

    mlflow = None
    if tracking_uri:
        import mlflow

        from dlm_toolkit.sweep.tracking import Tracker

        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment(experiment_id=Tracker(tracking_uri, "dlm-train").experiment_id)  # artifacts by the store
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


def _save(model: LLaDA2MoeModelLM, tokenizer: Any, config: TrainConfig, out: Path, wall: float, cpu: float,
          final_loss: float, history: list[dict], evals: list[dict]) -> None:
    if config.save_dtype == "bfloat16":
        stored = LLaDA2MoeModelLM(model.config, dtype=torch.bfloat16)  # the router stays float32
        stored.load_state_dict(model.state_dict())
    else:
        stored = model
    save_model(stored, out)
    save_tokenizer(tokenizer, out)
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
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    plot_loss(history, out / "loss_curve.png")


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
    ax.plot([h["step"] for h in history], [h["loss"] for h in history])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
