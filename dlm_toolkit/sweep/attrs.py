"""The experiment settings stored on an Optuna study, in user attributes of at most 1 KB each.

optuna-dashboard cuts any attribute at 1,024 characters without notice, so the settings JSON is
split into ``experiment.0``, ``experiment.1``, ... (``experiment.parts`` says how many). Studies
made before the split hold one ``experiment`` attribute; :func:`read_settings` reads both.
"""

from __future__ import annotations

import json
from typing import Any

CHUNK = 1000  # stored characters per attribute, escapes and quotes included (under 1 KB)


def write_settings(study: Any, settings: dict[str, Any]) -> None:
    """Store ``settings`` on ``study`` (replacing what is there)."""
    parts, part, size = [], [], 2  # size: the stored (JSON-escaped) length of the part, quotes included
    for ch in json.dumps(settings, sort_keys=True):
        grow = len(json.dumps(ch)) - 2  # '"' and '\\' take two characters once stored
        if size + grow > CHUNK:
            parts.append("".join(part))
            part, size = [], 2
        part.append(ch)
        size += grow
    parts.append("".join(part))
    for i, part in enumerate(parts):
        study.set_user_attr(f"experiment.{i}", part)
    study.set_user_attr("experiment.parts", len(parts))  # last: a reader never sees a partial count


def read_settings(study: Any) -> dict[str, Any] | None:
    """The settings :func:`write_settings` stored (or a pre-split study's), else None."""
    attrs = study.user_attrs
    parts = attrs.get("experiment.parts")
    if isinstance(parts, int) and parts > 0:
        return json.loads("".join(attrs.get(f"experiment.{i}", "") for i in range(parts)))
    legacy = attrs.get("experiment")
    return legacy if isinstance(legacy, dict) else None
