"""Adapter: any Hugging Face masked LM (full bidirectional attention) as a :class:`DiffusionLM`.

LLaDA-1-style models (and BERT-like masked LMs) see the whole canvas every forward; there is no
KV cache. Loading is local-only (``local_files_only=True``) and never runs repository code
unless the caller passes ``trust_remote_code=True`` explicitly.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from dlm_toolkit.config import ConfigError


class HFMaskedLM:
    """Wrap ``AutoModelForMaskedLM`` (or a given ``transformers`` model) for the decode engine.

    Args:
        model: a loaded ``transformers`` model returning ``.logits`` of shape (B, T, V).
        mask_token_id, eos_token_id: special ids (see :meth:`from_pretrained` for reading them
            from the tokenizer).
    """

    attention = "full"
    supports_kv_cache = False

    def __init__(self, model: Any, mask_token_id: int, eos_token_id: int) -> None:
        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)
        self.mask_token_id, self.eos_token_id = int(mask_token_id), int(eos_token_id)
        self._takes_positions = "position_ids" in inspect.signature(model.forward).parameters

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        mask_token_id: int | None = None,
        eos_token_id: int | None = None,
        trust_remote_code: bool = False,
        dtype: torch.dtype = torch.float32,
    ) -> HFMaskedLM:
        """Load a local folder; special ids default to the tokenizer's mask and EOS (or SEP) tokens."""
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        model = AutoModelForMaskedLM.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=trust_remote_code, dtype=dtype
        )
        if mask_token_id is None or eos_token_id is None:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
            mask_token_id = tok.mask_token_id if mask_token_id is None else mask_token_id
            eos_token_id = next((i for i in (eos_token_id, tok.eos_token_id, tok.sep_token_id) if i is not None), None)
        if mask_token_id is None or eos_token_id is None:
            raise ConfigError(f"{path}: no mask/EOS token id in the tokenizer; pass mask_token_id/eos_token_id")
        return cls(model, mask_token_id, eos_token_id)

    def new_cache(self, batch_size: int, max_length: int) -> None:
        raise NotImplementedError("full-attention models keep no KV cache")

    def forward_window(self, input_ids, position_ids, attn_mask, cache=None, cache_rows=None, cache_write=None):
        # Full attention: the engine's mask is "every real key" for every query; the last query
        # of a left-padded row is always real, so its mask row is the key-padding mask.
        kwargs: dict[str, Any] = {"attention_mask": attn_mask[:, -1, :].long()}
        if self._takes_positions:
            kwargs["position_ids"] = position_ids
        return self.model(input_ids=input_ids, **kwargs).logits.float()
