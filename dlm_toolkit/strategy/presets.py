"""Named policies (presets) live as JSON files under ``experiments/configs/``; reading one is
:func:`dlm_toolkit.strategy.policy_config.load_policy`'s job."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PRESET = "llada2.1-q"


def presets_dir() -> Path:
    """``$DLM_PRESETS_DIR`` if set, else ``experiments/configs`` of this source tree."""
    env = os.environ.get("DLM_PRESETS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "experiments" / "configs"


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.json"))
