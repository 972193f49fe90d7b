"""The block-diffusion attention mask of a ``[x_t ; x_0]`` row, shared by training
(:mod:`dlm_toolkit.training.objective`) and likelihood scoring (:mod:`dlm_toolkit.integrations.loglik`).

It lives with the model because it is the model's input convention, not a training detail: the
scorer uses it without importing the trainer.
"""

from __future__ import annotations

import torch

__all__ = ["block_diffusion_attn_mask"]


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
