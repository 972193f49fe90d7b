"""Named policies (presets) live as JSON files under ``experiments/configs/``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import yaml

from dlm_toolkit.config import ConfigError, PolicyConfig

DEFAULT_PRESET = "llada2.1-q"


def presets_dir() -> Path:
    """``$DLM_PRESETS_DIR`` if set, else ``experiments/configs`` of this source tree."""
    env = os.environ.get("DLM_PRESETS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "experiments" / "configs"


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.json"))


def read_file(path: Path) -> dict[str, Any]:
    """A policy dict from a ``.json`` or ``.yaml``/``.yml`` file (safe loaders only)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read policy file {path}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def read_policy_source(source: str | Path | Mapping[str, Any] | PolicyConfig | None) -> dict[str, Any]:
    if source is None:
        source = DEFAULT_PRESET
    if isinstance(source, PolicyConfig):
        return source.model_dump(mode="json")
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if path.suffix in (".json", ".yaml", ".yml") and path.exists():
        return read_file(path)
    preset = presets_dir() / f"{source}.json"
    if preset.exists():
        return read_file(preset)
    raise ConfigError(
        f"unknown preset or policy file '{source}' (presets: {', '.join(list_presets()) or 'none found'})"
    )
