"""A complete decoding policy as data: :class:`PolicyConfig` (four roles plus sampling, each role's
params validated by its registered rule's ``Config``) and :func:`load_policy` (presets, files, dicts
and flat-key overrides).

Layering: :mod:`dlm_toolkit.config` (plain config helpers) <- :mod:`dlm_toolkit.strategy.registry` <- this
module; :mod:`dlm_toolkit.strategy.presets` only knows where preset files live.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, model_validator

from dlm_toolkit.config import (
    ROLES,
    ConfigError,
    RoleSpec,
    SamplingConfig,
    flatten,
    read_mapping_file,
    set_dotted,
    validate_model,
)
from dlm_toolkit.strategy.presets import DEFAULT_PRESET, list_presets, presets_dir
from dlm_toolkit.strategy.registry import REGISTRIES


class PolicyConfig(BaseModel):
    """A complete decoding policy. Construct with :func:`load_policy` or ``model_validate``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    m2t: RoleSpec
    t2t: RoleSpec = RoleSpec(name="none")
    blocks: RoleSpec
    remask: RoleSpec = RoleSpec(name="none")
    sampling: SamplingConfig = SamplingConfig()

    @model_validator(mode="before")
    @classmethod
    def _resolve_roles(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for role in ROLES:
            spec = data.get(role)
            if spec is None:
                continue
            if isinstance(spec, RoleSpec):
                spec = spec.model_dump()
            if not isinstance(spec, Mapping) or "name" not in spec:
                raise ValueError(f"{role}: expected {{name: ..., params: {{...}}}}, got {spec!r}")
            unknown = set(spec) - {"name", "params"}
            if unknown:
                raise ValueError(f"{role}: unknown keys {sorted(unknown)} (allowed: name, params)")
            rule = REGISTRIES[role].get(str(spec["name"]))
            params = validate_model(rule.Config, dict(spec.get("params") or {}), f"{role}.params")
            data[role] = {"name": str(spec["name"]), "params": params.model_dump(mode="json")}
        return data

    def canonical_json(self) -> str:
        """Sorted, whitespace-free JSON of the complete config: the source of truth and hash input."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def config_hash(self) -> str:
        """Short stable hash of :meth:`canonical_json` (12 hex digits)."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:12]

    def flat(self) -> dict[str, Any]:
        """Flat dotted keys, e.g. ``{"m2t.name": "threshold", "m2t.params.threshold": 0.7}``."""
        return flatten(self.model_dump(mode="json"))


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


def apply_overrides(policy: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Apply flat-key overrides to a policy dict (not yet validated).

    ``ROLE.name=X`` switches the role's rule and resets its params to X's defaults *before*
    any ``ROLE.params.*`` given alongside are applied, so ``t2t.name=none`` never inherits the
    old rule's params. Unknown top-level groups are rejected with the allowed ones.
    """
    tree = json.loads(json.dumps(dict(policy)))  # deep copy, plain types
    allowed = (*ROLES, "sampling")
    for key in overrides:
        if key.split(".")[0] not in allowed:
            raise ConfigError(f"{key}: unknown key (top level must be one of {', '.join(allowed)})")
    for key, value in overrides.items():
        parts = key.split(".")
        if len(parts) == 2 and parts[0] in ROLES and parts[1] == "name":
            tree[parts[0]] = {"name": value, "params": {}}
    for key, value in overrides.items():
        parts = key.split(".")
        if parts[0] in ROLES and parts[1:] == ["name"]:
            continue
        if parts[0] in ROLES and (len(parts) != 3 or parts[1] != "params"):
            raise ConfigError(f"{key}: role keys are '{parts[0]}.name' or '{parts[0]}.params.FIELD'")
        if not isinstance(tree.get(parts[0], {}), dict):
            raise ConfigError(f"{key}: '{parts[0]}' is a value, not a group")
        set_dotted(tree, key, value)
    return tree


def load_policy(
    source: str | Path | Mapping[str, Any] | PolicyConfig | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PolicyConfig:
    """Build a validated policy from a preset name, a JSON/YAML file, a dict or a policy.

    Args:
        source: preset name (see :func:`dlm_toolkit.strategy.presets.list_presets`), path to a
            ``.json``/``.yaml`` file, a dict, or an existing policy. None means ``llada2.1-q``.
        overrides: flat-key overrides applied with :func:`apply_overrides`.

    Raises:
        ConfigError: unknown preset/file, unknown rule names, or invalid values.
    """
    base = read_policy_source(source)
    tree = apply_overrides(base, overrides or {})
    return validate_model(PolicyConfig, tree)
