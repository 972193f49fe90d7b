"""The configuration of a training run (:func:`dlm_toolkit.training.loop.train`): every knob, with ranges.

Load it with :func:`load_train_config` (YAML/JSON file or dict, plus flat-key overrides such as
``tasks.add=2``); a bad value raises :class:`~dlm_toolkit.config.ConfigError` naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dlm_toolkit.config import flatten, read_mapping_file, set_dotted, validate_model
from dlm_toolkit.models.llada2 import LLaDA2Config
from dlm_toolkit.sweep.experiment import PRIVILEGED_TASK_ARGS
from dlm_toolkit.tasks import TASKS, Task, get_task

__all__ = ["TrainConfig", "load_train_config"]

Rate = Annotated[float, Field(ge=0.0, le=1.0)]

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
    rope_theta: float = Field(600000.0, gt=1.0, le=1e9)  # as the model config: (1, ...], else the model build refuses it after the claim
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
            asked = sorted(set(self.task_params.get(name, {})) & set(PRIVILEGED_TASK_ARGS))
            if asked:  # a config file is handed around like an experiment file: it grants no privilege
                raise ValueError(f"task_params.{name}.{asked[0]}: a privilege only the command line grants "
                                 f"(`dlm eval/sweep {PRIVILEGED_TASK_ARGS[asked[0]]}`); a training config never does")
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
