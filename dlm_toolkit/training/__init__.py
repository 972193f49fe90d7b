"""Training: the loop, its config, objective, claims and resume.

Re-exports the public names of ``loop.py`` (the module this package replaced)."""

from dlm_toolkit.training.loop import (  # noqa: F401
    Batch,
    TrainConfig,
    block_diffusion_attn_mask,
    build_model,
    canvas_tokens,
    check_out,
    corruption_candidates,
    load_train_config,
    loss_fn,
    make_batch,
    random_other_token,
    train,
)

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
