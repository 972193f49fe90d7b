"""LLaDA2 configuration (the ``config.json`` fields the model reads) and tensor/expert parallelism
(which slice of each weight a rank holds; :func:`shard_problems` says why a split cannot work)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# ----------------------------------------------------------------------------------------------
# Config


class LLaDA2Config(BaseModel):
    """The fields of an official LLaDA2 ``config.json`` that the model reads.

    Types are strict (``vocab_size: "128"`` or ``first_k_dense_replace: true`` are refused, not
    coerced) and floats finite and in a range a model can decode with (``rope_theta`` in (1, 1e12],
    ``rms_norm_eps`` in [1e-12, 0.1]). Official configs carry ~48 keys; the ones not listed here (``architectures``,
    ``torch_dtype``, dropout rates, ...) are kept as extras (``extra="allow"``) so that saving a
    loaded model writes them back unchanged. ``mask_token_id``/``eos_token_id`` are not in the
    official configs (they come from the tokenizer) but our own checkpoints store them here.
    """

    # strict: "128" or true where an integer belongs is refused, never coerced; floats finite
    model_config = ConfigDict(frozen=True, extra="allow", protected_namespaces=(), strict=True, allow_inf_nan=False)

    model_type: Literal["llada2_moe"] = "llada2_moe"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    num_shared_experts: int = Field(ge=0)
    n_group: int = Field(gt=0)
    topk_group: int = Field(gt=0)
    routed_scaling_factor: float = Field(gt=0, le=1e6)
    first_k_dense_replace: int = Field(ge=0)
    rms_norm_eps: float = Field(ge=1e-12, le=0.1)  # 1e-6 in the released models; outside, decodes are noise
    rope_theta: float = Field(gt=1, le=1e12)  # 600000 released; inf or 1e308 gives no rotation at all
    partial_rotary_factor: float = Field(gt=0, le=1)
    max_position_embeddings: int = Field(gt=0, le=1 << 20)  # 32768 released; past 1M positions no model here runs
    initializer_range: float = Field(default=0.02, gt=0)
    tie_word_embeddings: bool = False
    mask_token_id: int | None = Field(default=None, ge=0)
    eos_token_id: int | None = Field(default=None, ge=0)

    @field_validator("tie_word_embeddings")
    @classmethod
    def _untied(cls, v: bool) -> bool:
        if v:
            raise ValueError("tie_word_embeddings=true is not supported: LLaDA2 has an untied lm_head")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> LLaDA2Config:
        def bad(field: str, msg: str) -> None:
            raise ValueError(f"{field}: {msg}")

        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"must divide num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}")
        if self.num_experts % self.n_group:
            bad("n_group", f"must divide num_experts={self.num_experts}, got {self.n_group}")
        if self.num_experts // self.n_group < 2:
            bad("n_group", f"groups need >= 2 experts (group score = sum of top-2), so n_group must be "
                f"in [1, {self.num_experts // 2}], got {self.n_group}")
        if self.topk_group > self.n_group:
            bad("topk_group", f"must be in [1, n_group={self.n_group}], got {self.topk_group}")
        kept = self.topk_group * (self.num_experts // self.n_group)
        if self.num_experts_per_tok > kept:
            bad("num_experts_per_tok", f"must be in [1, {kept}] (experts in the topk_group kept groups), "
                f"got {self.num_experts_per_tok}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            bad("first_k_dense_replace", f"must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}")
        rot = self.rotary_dim
        if rot < 2 or rot % 2:
            bad("partial_rotary_factor", f"head_dim * partial_rotary_factor = {rot} must be an even number "
                f">= 2 (head_dim={self.head_dim}, partial_rotary_factor={self.partial_rotary_factor})")
        for name in ("mask_token_id", "eos_token_id"):
            tid = getattr(self, name)
            if tid is not None and tid >= self.vocab_size:
                bad(name, f"must be in [0, vocab_size={self.vocab_size}), got {tid}")
        return self

    @property
    def rotary_dim(self) -> int:
        # The reference uses int(head_dim * partial_rotary_factor) and ignores the `rotary_dim` key.
        return int(self.head_dim * self.partial_rotary_factor)

    def to_hf_dict(self) -> dict:
        """The full key set of the released LLaDA2.x ``config.json`` files (so a checkpoint we write
        loads in the reference remote code without extra arguments and with no weight newly
        initialised), every extra key this config was read with, and our special ids.

        Keys our architecture fixes (``use_bias: false``, sigmoid routing, QK-norm, ...) take the
        released values unless the config was read with them; ``pad_token_id`` is the EOS id, as in
        the released models (absent, the reference's padding index defaults to 156892).
        """
        import transformers

        d = self.model_dump()
        for name in ("mask_token_id", "eos_token_id"):
            if d[name] is None:
                del d[name]
        fixed = dict(OFFICIAL_CONFIG_DEFAULTS, rotary_dim=self.rotary_dim, transformers_version=transformers.__version__)
        if self.eos_token_id is not None:
            fixed["pad_token_id"] = self.eos_token_id
        for key, value in fixed.items():
            d.setdefault(key, value)
        return d


OFFICIAL_CONFIG_DEFAULTS: dict[str, Any] = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "attention_dropout": 0.0,
    "embedding_dropout": 0.0, "output_dropout": 0.0, "hidden_act": "silu", "max_window_layers": 28,
    "moe_router_enable_expert_bias": True, "norm_head": False, "norm_softmax": False, "norm_topk_prob": True,
    "output_router_logits": False, "rope_scaling": None, "router_dtype": "fp32", "score_function": "sigmoid",
    "sliding_window": 4096, "use_bias": False, "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False,
    "use_rmsnorm": True, "use_sliding_window": False, "using_split_qkv_in_self_attention": False,
}
"""Released-config keys whose values our architecture fixes (see :meth:`LLaDA2Config.to_hf_dict`)."""


# ----------------------------------------------------------------------------------------------
# Tensor + expert parallelism


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor/expert-parallel group: rank ``rank`` of ``world``.

    ``group`` is the ``torch.distributed`` process group to all-reduce over (``None``: the default
    group). ``world == 1`` is the ordinary single-device model (no communication).
    """

    rank: int = 0
    world: int = 1
    group: Any = None

    def span(self, n: int) -> tuple[int, int]:
        """This rank's contiguous share ``[lo, hi)`` of ``n`` items split evenly (``n % world == 0``)."""
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, n_kv: int) -> tuple[int, int]:
        """KV heads ``[lo, hi)`` of this rank: split when ``world`` divides ``n_kv``, else each head is
        replicated on ``world / n_kv`` consecutive ranks (the ranks whose query heads use it)."""
        if n_kv % self.world == 0:
            return self.span(n_kv)
        lo = self.rank // (self.world // n_kv)
        return lo, lo + 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the ranks (``t`` itself on one rank). The sum is taken in float32: each
        partial is then rounded once, as a single device rounds its one matmul output once."""
        if self.world == 1:
            return t
        import torch.distributed as dist

        total = t.float()
        dist.all_reduce(total, group=self.group)
        return total.to(t.dtype)


SINGLE = TensorParallel()


def shard_problems(cfg: LLaDA2Config, world: int) -> list[str]:
    """Why ``cfg`` cannot be split over ``world`` ranks (empty when it can), one line per field."""
    if world < 1:
        return [f"world size must be >= 1, got {world}"]
    out = []

    def need(field: str, n: int) -> None:
        if n % world:
            out.append(f"{field}={n} is not divisible by the world size {world}")

    need("num_attention_heads", cfg.num_attention_heads)
    nkv = cfg.num_key_value_heads
    if nkv % world and world % nkv:
        out.append(f"num_key_value_heads={nkv}: the world size {world} must divide it or be a multiple of it")
    need("num_experts", cfg.num_experts)
    if cfg.first_k_dense_replace:
        need("intermediate_size", cfg.intermediate_size)
    if cfg.num_shared_experts:
        need("moe_intermediate_size * num_shared_experts", cfg.moe_intermediate_size * cfg.num_shared_experts)
    return out
