"""Policy configuration: validated, frozen, hashable, flattenable.

A policy is ``{m2t, t2t, blocks, remask, sampling}``; the four roles are ``{name, params}``
resolved through the strategy registries, so ``params`` are validated by the chosen rule's own
``Config``. Flat dotted keys (``m2t.params.threshold``) are the names used by ``--set``, Optuna
parameters and MLflow params alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import annotated_types as at
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from dlm_toolkit.util.errors import ConfigError  # re-exported: its home is the bottom layer
from dlm_toolkit.util.files import MAX_JSON_DEPTH, InputFileError, parse_json, read_text

ROLES = ("m2t", "t2t", "blocks", "remask")


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
    :mod:`dlm_toolkit.step.sampling`.
    """

    temperature: float = Field(0.0, ge=0.0, le=10.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    gumbel_float64: bool = False


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

    Bounded: only regular files (a FIFO, ``/dev/zero`` or a folder is refused before reading),
    at most 1 MiB, nested at most :data:`~dlm_toolkit.util.files.MAX_JSON_DEPTH` levels, and no YAML
    anchors or aliases (a few hundred bytes of nested aliases expand to gigabytes; no config of
    ours needs them).
    """
    path = Path(path)
    try:
        text = read_text(path, MAX_CONFIG_BYTES, "a config file")
        if path.suffix == ".json":
            data = parse_json(text, str(path))
        else:
            _check_yaml(path, text)
            data = yaml.safe_load(text)
    except InputFileError as err:
        raise ConfigError(str(err)) from None
    except yaml.YAMLError as err:  # one line: where and what, without the excerpt the error prints
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        what = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"{where}: not valid YAML ({what})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _check_yaml(path: Path, text: str) -> None:
    """Refuse anchors/aliases, nesting deeper than ``MAX_JSON_DEPTH`` and a key given twice in one
    mapping (YAML loaders keep the last silently), from the event stream (the parser is iterative;
    only the composer that builds the objects recurses)."""
    # one entry per open collection: None for a sequence; for a mapping [key -> line, next node is a key?]
    open_nodes: list[list[Any] | None] = []

    def node_done() -> None:
        if open_nodes and open_nodes[-1] is not None:
            open_nodes[-1][1] = not open_nodes[-1][1]

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise ConfigError(f"{path}:{line}: YAML anchors and aliases are not accepted in config files "
                              f"(found {'*' if isinstance(event, yaml.AliasEvent) else '&'}{event.anchor})")
        if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(open_nodes) >= MAX_JSON_DEPTH:
                raise ConfigError(f"{path}:{line}: nested deeper than {MAX_JSON_DEPTH} levels")
            open_nodes.append([{}, True] if isinstance(event, yaml.MappingStartEvent) else None)
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            open_nodes.pop()
            node_done()
        elif isinstance(event, yaml.ScalarEvent):
            top = open_nodes[-1] if open_nodes else None
            if top is not None and top[1]:  # a key of the innermost mapping
                if event.value in top[0]:
                    raise ConfigError(f"{path}:{line}: duplicate key '{event.value}' (first on line "
                                      f"{top[0][event.value]}); a key may appear once in a mapping")
                top[0][event.value] = line
            node_done()


def parse_value(text: str) -> Any:
    """CLI value parsing: JSON where it parses (numbers, true/false, null, lists), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def utf8_argument(text: str, option: str) -> str:
    """``text`` as given on the command line, refused if its bytes were not UTF-8.

    Python decodes ``argv`` with ``surrogateescape``: each byte that is not part of valid UTF-8
    arrives as a lone surrogate, which a tokenizer, SQLAlchemy or SQLite cannot encode. The error
    names ``option``, the first such byte and its offset in the argument."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raw = text.encode("utf-8", "surrogateescape")
        offset = len(text[:err.start].encode("utf-8", "surrogateescape"))
        raise ConfigError(f"{option}: not valid UTF-8 (byte 0x{raw[offset]:02x} at byte offset {offset})") from None
    return text
