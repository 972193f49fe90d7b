"""Shared helpers of the sweep/eval tests: a tiny random checkpoint and a pre-initialised MLflow store.

Creating a fresh MLflow SQLite store runs its migrations (~5 s); tests copy one initialised file.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_SCRIPT = Path(sys.executable).with_name("dlm")
DLM = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "dlm_toolkit.cli"]

_TMP = Path(tempfile.mkdtemp(prefix="dlm-sweep-tests-"))
atexit.register(shutil.rmtree, _TMP, True)


def make_checkpoint(path: Path, max_position_embeddings: int = 128, tokenizer: bool = True, seed: int = 0) -> Path:
    """A random tiny LLaDA2 checkpoint with the character tokenizer (decodes in milliseconds)."""
    from dlm_toolkit.models import save_model
    from dlm_toolkit.testing.models import tiny_llada2
    from dlm_toolkit.models.tokenizer import build_char_tokenizer, save_tokenizer, special_ids

    tok = build_char_tokenizer()
    mask, eos = special_ids(tok)
    model = tiny_llada2(seed=seed, vocab_size=128, mask_token_id=mask, eos_token_id=eos,
                        max_position_embeddings=max_position_embeddings)
    save_model(model, path)
    if tokenizer:
        save_tokenizer(tok, path)
    return path


@functools.lru_cache(maxsize=None)
def checkpoint() -> Path:
    """One shared tiny checkpoint for the whole session (read-only by convention)."""
    return make_checkpoint(_TMP / "ckpt")


@functools.lru_cache(maxsize=None)
def _mlflow_template() -> Path:
    from mlflow import MlflowClient

    db = _TMP / "mlflow-template.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


def tracking_uri(folder: Path) -> str:
    """A fresh, already initialised MLflow SQLite store in ``folder``."""
    db = folder / "mlflow.db"
    shutil.copy(_mlflow_template(), db)
    return f"sqlite:///{db}"


def experiment(model: Path | str | None = None, **overrides: Any) -> dict[str, Any]:
    """A small experiment dict (8 add instances in batches of 4 per trial)."""
    data: dict[str, Any] = {
        "name": "t",
        "model": str(model or checkpoint()),
        "task": "add",
        "n": 8,
        "seed": 0,
        "batch_size": 4,
        "base_policy": "llada2.1-q",
        "search_space": {
            "m2t.params.threshold": {"float": [0.3, 0.99]},
            "t2t.name": {"categorical": ["none", "threshold"]},
            "t2t.params.threshold": {"float": [0.0, 0.95], "when": {"t2t.name": "threshold"}},
            "blocks.params.block_length": {"categorical": [32, 8, 16]},  # stored in ascending order
        },
        "sampler": {"name": "random", "seed": 0},
    }
    data.update(overrides)
    return data


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def dlm(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*DLM, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def runs(uri: str, experiment_name: str = "dlm-sweep") -> list[Any]:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment_name)
    return [] if exp is None else client.search_runs([exp.experiment_id], max_results=1000)


def children(parent: int, marker: bytes) -> list[int]:
    """Pids of the live child processes of ``parent`` whose command line contains ``marker``."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(parent) and marker in cmdline:
            found.append(int(status.parent.name))
    return found


def artifacts(uri: str, run_id: str) -> list[Any]:
    from mlflow import MlflowClient

    return MlflowClient(uri).list_artifacts(run_id)


import pytest


@pytest.fixture(autouse=False)
def restore_torch_threads():
    """`--threads` sets torch's global thread count; give it back to the rest of the session."""
    import torch

    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)
