"""What strategies exist: every registered rule by role, its source and its config fields."""

from __future__ import annotations

import inspect
import sys
from typing import Any, Literal, get_args, get_origin

from pydantic_core import PydanticUndefined

from dlm_toolkit.config import describe_range
from dlm_toolkit.strategy.registry import REGISTRIES, plugin_status


def summary(cls: type) -> str:
    """First line of the class docstring, else of its module's docstring."""
    # a class can outlive its module's sys.modules entry (a plug-in loaded from a file, a test that unloads it)
    doc = inspect.getdoc(cls) if cls.__doc__ else (getattr(sys.modules.get(cls.__module__), "__doc__", None) or "")
    return doc.strip().splitlines()[0] if doc and doc.strip() else ""


def type_name(ann: Any) -> str:
    if get_origin(ann) is Literal:
        return "|".join(map(str, get_args(ann)))
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def config_fields(cls: type) -> list[dict[str, Any]]:
    out = []
    for name, field in cls.Config.model_fields.items():
        ann = field.annotation
        default = None if field.default is PydanticUndefined else field.default
        out.append(
            {
                "name": name,
                "type": type_name(ann),
                "default": default,
                "range": describe_range(field),
                "description": field.description or "",
            }
        )
    return out


def describe_strategies() -> dict[str, Any]:
    """``{"roles": {role: [{name, source, summary, fields}]}, "failed_plugins": {...}}``."""
    roles = {
        role: [
            {"name": e.name, "source": e.source, "class": f"{e.cls.__module__}:{e.cls.__qualname__}",
             "summary": summary(e.cls), "fields": config_fields(e.cls)}
            for e in reg.entries()
        ]
        for role, reg in REGISTRIES.items()
    }
    status = plugin_status()
    return {"roles": roles, "plugins": status["loaded"], "failed_plugins": status["failed"]}
