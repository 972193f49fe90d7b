"""Named policies (presets) live as JSON files under ``experiments/configs/``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from dlm_toolkit.config import ConfigError, PolicyConfig, read_mapping_file

DEFAULT_PRESET = "llada2.1-q"


def presets_dir() -> Path:
    """``$DLM_PRESETS_DIR`` if set, else ``experiments/configs`` of this source tree."""
    env = os.environ.get("DLM_PRESETS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "experiments" / "configs"


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.json"))


def read_policy_source(source: str | Path | Mapping[str, Any] | PolicyConfig | None) -> dict[str, Any]:
    if source is None:
        source = DEFAULT_PRESET
    if isinstance(source, PolicyConfig):
        return source.model_dump(mode="json")
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.suffix in (".json", ".yaml", ".yml") and path.exists():
        return read_mapping_file(path)
    preset = presets_dir() / f"{source}.json"
    if preset.exists():
        return read_mapping_file(preset)
    raise ConfigError(
        f"unknown preset or policy file '{source}' (presets: {', '.join(list_presets()) or 'none found'})"
    )
