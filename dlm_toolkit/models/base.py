"""The shared model interface every decoder in dlm-toolkit talks to.

A diffusion LM here is anything that maps a window of tokens (with absolute positions and a
boolean attention pattern) to logits for every window position. The decode engine builds the
attention pattern; models only apply it. Block-causal models may also keep an exact prefix KV
cache of finished blocks: the engine decides which window positions are
written into the cache, the model stores their keys/values at their absolute positions.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch

AttentionKind = Literal["block_causal", "full"]


@runtime_checkable
class DiffusionLM(Protocol):
    """Protocol for masked/block diffusion language models.

    Attributes:
        mask_token_id: id of the mask token (read from config/tokenizer, never hard-coded).
        eos_token_id: id of the end-of-sequence token.
        vocab_size: number of logits per position.
        attention: ``"block_causal"`` (LLaDA2: position i sees j iff ``j // B <= i // B``) or
            ``"full"`` (LLaDA-1 style: every position sees every non-padding position).
        supports_kv_cache: whether :meth:`new_cache` and the ``cache`` arguments work.
    """

    mask_token_id: int
    eos_token_id: int
    vocab_size: int
    attention: AttentionKind
    supports_kv_cache: bool

    def new_cache(self, batch_size: int, max_length: int) -> Any:
        """An empty KV cache for ``batch_size`` rows of up to ``max_length`` absolute positions."""
        ...

    def forward_window(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor,
        cache: Any | None = None,
        cache_rows: torch.Tensor | None = None,
        cache_write: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every window position.

        Args:
            input_ids: ``(B, T)`` token ids of the window (padding positions hold any valid id).
            position_ids: ``(B, T)`` absolute positions (RoPE uses them; cache writes go there).
            attn_mask: ``(B, T, S + T)`` bool, True where query t may attend key s. The first
                ``S`` key columns are cache positions ``0..S-1`` (absolute), the last ``T`` are
                the window itself. ``S = 0`` without a cache.
            cache: a cache from :meth:`new_cache`, or None.
            cache_rows: ``(B,)`` long, which cache row each window row uses (rows of a batch
                drop out as they finish, so window row b need not be cache row b).
            cache_write: ``(B, T)`` bool, window positions whose keys/values are stored in the
                cache at their absolute position after this forward.

        Returns:
            ``(B, T, vocab_size)`` float32 logits; logits at position i predict the token at i.
        """
        ...


def model_device(model: Any) -> torch.device:
    """The device a model computes on: its ``device`` attribute, else its first parameter's, else
    the CPU (scripted models without weights). The decode runs there."""
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        first = next(iter(parameters()), None)
        if first is not None:
            return first.device
    return torch.device("cpu")
