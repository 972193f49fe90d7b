"""Policy configuration: validated, frozen, hashable, flattenable.

A policy is ``{m2t, t2t, blocks, remask, sampling}``; the four roles are ``{name, params}``
resolved through the strategy registries, so ``params`` are validated by the chosen rule's own
``Config``. Flat dotted keys (``m2t.params.threshold``) are the names used by ``--set``, Optuna
parameters and MLflow params alike.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import annotated_types as at
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

ROLES = ("m2t", "t2t", "blocks", "remask")


class ConfigError(ValueError):
    """An invalid configuration; the message names the field path, the value and what is allowed."""


class StrategyConfig(BaseModel):
    """Base class of every strategy's nested ``Config``: frozen, unknown keys rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def describe_range(field: FieldInfo) -> str:
    """Human-readable allowed range of a numeric field, e.g. ``0 < x <= 1`` ('' if unbounded)."""
    lo = hi = ""
    for m in field.metadata:
        if isinstance(m, at.Gt):
            lo = f"{m.gt} < "
        elif isinstance(m, at.Ge):
            lo = f"{m.ge} <= "
        elif isinstance(m, at.Lt):
            hi = f" < {m.lt}"
        elif isinstance(m, at.Le):
            hi = f" <= {m.le}"
    return f"{lo}x{hi}" if lo or hi else ""


def _field_at(model: type[BaseModel] | None, loc: tuple) -> FieldInfo | None:
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return field


def format_validation_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per problem: ``path: message (got VALUE; allowed: RANGE)``."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        path = ".".join([prefix] * bool(prefix) + [str(p) for p in loc]) or "<root>"
        if e["type"] == "value_error":  # our own validators already wrote a full message
            lines.append(str(e["ctx"]["error"]))
            continue
        msg = f"{path}: {e['msg']}"
        if e["type"] != "missing":
            msg += f" (got {e['input']!r}"
            field = _field_at(model, loc)
            rng = describe_range(field) if field is not None else ""
            msg += f"; allowed: {rng})" if rng else ")"
        lines.append(msg)
    return "\n".join(lines)


def validate_model(model: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """``model.model_validate(data)`` raising :class:`ConfigError` with readable messages."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, model, prefix)) from None


class RoleSpec(BaseModel):
    """One role of a policy: a registered rule name and its (validated, complete) params."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class SamplingConfig(StrategyConfig):
    """How a token and its confidence are drawn from the logits at each position.

    ``confidence`` is always the probability of the drawn token under the *untempered* softmax
    over the whole vocabulary, mask token included (as LLaDA, Fast-dLLM and LLaDA2.1 do), so
    presets reproduce the reference decisions exactly. Where the drawn token is the mask token
    (degenerate models only), the best non-mask token is written instead: see
    :mod:`dlm_toolkit.sampling`.
    """

    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    gumbel_float64: bool = False


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
        from dlm_toolkit.registry import REGISTRIES  # the registry imports this module

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


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """``tree["a"]["b"] = value`` for ``key = "a.b"``, creating groups on the way."""
    node = tree
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{part}' is a value, not a group")
    node[leaf] = value


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        set_dotted(tree, path, value)
    return tree


MAX_CONFIG_BYTES = 1 << 20  # no experiment, policy or training file comes near this


def read_mapping_file(path: str | Path) -> dict[str, Any]:
    """A mapping from a ``.json`` or ``.yaml``/``.yml`` file (safe loaders only; empty file = {}).

    Bounded: files over 1 MiB are refused, and so are YAML anchors and aliases (a few hundred
    bytes of nested aliases expand to gigabytes; no config of ours needs them).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size} bytes; config files are limited to {MAX_CONFIG_BYTES} bytes")
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason})") from None
    try:
        if path.suffix != ".json":
            _refuse_aliases(path, text)
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _refuse_aliases(path: Path, text: str) -> None:
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            line = event.start_mark.line + 1
            raise ConfigError(f"{path}:{line}: YAML anchors and aliases are not accepted in config files "
                              f"(found {'*' if isinstance(event, yaml.AliasEvent) else '&'}{event.anchor})")


def parse_value(text: str) -> Any:
    """CLI value parsing: JSON where it parses (numbers, true/false, null, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
        source: preset name (see :func:`dlm_toolkit.presets.list_presets`), path to a
            ``.json``/``.yaml`` file, a dict, or an existing policy. None means ``llada2.1-q``.
        overrides: flat-key overrides applied with :func:`apply_overrides`.

    Raises:
        ConfigError: unknown preset/file, unknown rule names, or invalid values.
    """
    from dlm_toolkit.presets import read_policy_source

    base = read_policy_source(source)
    tree = apply_overrides(base, overrides or {})
    return validate_model(PolicyConfig, tree)
