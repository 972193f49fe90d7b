"""Scripted models for tests: logits from a function, no weights."""

from __future__ import annotations

from typing import Callable

import torch

from dlm_toolkit.models.base import AttentionKind

LogitsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ScriptedLM:
    """A :class:`~dlm_toolkit.models.base.DiffusionLM` whose logits come from
    ``fn(input_ids (B,T), position_ids (B,T), attn_mask (B,T,T)) -> (B,T,V)``.

    It keeps no KV cache (the engine then forwards the whole prefix), so ``fn`` sees every
    visible position and the attention pattern the engine built.
    """

    supports_kv_cache = False

    def __init__(
        self,
        fn: LogitsFn,
        vocab_size: int,
        mask_token_id: int,
        eos_token_id: int,
        attention: AttentionKind = "block_causal",
        device: torch.device | str = "cpu",
    ) -> None:
        self.fn, self.vocab_size, self.device = fn, vocab_size, torch.device(device)
        self.mask_token_id, self.eos_token_id, self.attention = mask_token_id, eos_token_id, attention
        self.calls = 0

    def new_cache(self, batch_size: int, max_length: int) -> None:
        raise NotImplementedError("ScriptedLM keeps no KV cache")

    def forward_window(self, input_ids, position_ids, attn_mask, cache=None, cache_rows=None, cache_write=None):
        self.calls += 1
        return self.fn(input_ids, position_ids, attn_mask).float()


def mixing_logits(vocab_size: int, seed: int = 0, scale: float = 4.0, mix: float = 1.5) -> LogitsFn:
    """A seeded logits function that behaves like a tiny one-layer attention model: each
    position's logits = a per-position table + the mean embedding of the tokens it may attend
    to. Later blocks never influence earlier ones under block-causal masks, and written tokens
    change the logits of their neighbours (so T2T edits happen)."""
    gen = torch.Generator().manual_seed(seed)
    pos_table = torch.randn(4096, vocab_size, generator=gen) * scale
    tok_table = torch.randn(vocab_size, vocab_size, generator=gen) * mix

    def fn(input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        weights = attn_mask.float()  # (B, T, T)
        weights = weights / weights.sum(-1, keepdim=True)
        context = weights @ tok_table[input_ids]  # (B, T, V)
        return pos_table[position_ids] + context

    return fn


def table_logits(table: torch.Tensor) -> LogitsFn:
    """Logits read from a fixed ``(L, V)`` table by absolute position (ignores tokens)."""

    def fn(input_ids: torch.Tensor, position_ids: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        return table[position_ids]

    return fn
