"""Model interface and the native LLaDA2 MoE model with its checkpoint loader."""

from .base import DiffusionLM
from .checkpoint import CheckpointError, load_model, save_model
from .llada2 import KVCache, LLaDA2Config, LLaDA2MoeModelLM, TensorParallel

__all__ = [
    "CheckpointError",
    "DiffusionLM",
    "KVCache",
    "LLaDA2Config",
    "LLaDA2MoeModelLM",
    "TensorParallel",
    "load_model",
    "save_model",
]
