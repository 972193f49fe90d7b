"""What ``dlm sweep`` stores on an Optuna study and its trials, and reading it back *validated*.

Settings: the experiment's settings JSON, in user attributes of at most 1 KB each. optuna-dashboard
cuts any attribute at 1,024 characters without notice, so the JSON is split into ``experiment.0``,
``experiment.1``, ... (``experiment.parts`` says how many). Studies made before the split hold one
``experiment`` attribute; :func:`read_settings` reads both.

A study store is input like any other file: anyone with write access to the database can put a
list where an object belongs, a count of 10^9, JSON nested 100,000 deep or arguments a task does
not take. So everything is checked before use -- the settings by the same schema as the
experiment file (:class:`~dlm_toolkit.sweep.experiment.Experiment`, the task's registered name and
constructor arguments, ``n`` against the task's size), and each trial attribute
(:func:`trial_policy`, :func:`trial_metrics`, :func:`trial_outcomes`, :func:`trial_plugin_hashes`)
by its type and bounds -- and anything else raises :class:`~dlm_toolkit.config.ConfigError` naming
the study, the trial and the attribute.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import InputFileError, parse_json

CHUNK = 1000  # stored characters per attribute, escapes and quotes included (under 1 KB)
MAX_SETTINGS_CHARS = 1 << 20  # an experiment file is at most 1 MiB; its settings JSON no more
MAX_PARTS = MAX_SETTINGS_CHARS // (CHUNK // 2) + 1  # escapes take two stored characters
MAX_POLICY_CHARS = 1 << 16
_OUTCOMES = re.compile(r"(\d{1,7}):([0-9a-f]*)")


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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_settings(study: Any) -> dict[str, Any] | None:
    """The settings :func:`write_settings` stored (or a pre-split study's), validated; None if absent.

    Raises:
        ConfigError: see :func:`stored_settings`, or settings the experiment schema refuses.
    """
    data = stored_settings(study)
    return None if data is None else validate_settings(data, f"study {study.study_name!r}: stored experiment settings")


def stored_settings(study: Any) -> Any:
    """The JSON value :func:`write_settings` stored, not yet validated; None if absent.

    Raises:
        ConfigError: a part count or part that is not what write_settings writes, or JSON that
            does not parse or nests deeper than 64 levels.
    """
    where = f"study {study.study_name!r}"
    attrs = study.user_attrs
    if "experiment.parts" in attrs:
        parts = attrs["experiment.parts"]
        if type(parts) is not int or not 1 <= parts <= MAX_PARTS:
            raise ConfigError(f"{where}: attribute experiment.parts must be an integer in [1, {MAX_PARTS}], "
                              f"got {_short(parts)}")
        chunks = [attrs.get(f"experiment.{i}") for i in range(parts)]
        bad = next((i for i, c in enumerate(chunks) if not isinstance(c, str)), None)
        if bad is not None:
            raise ConfigError(f"{where}: attribute experiment.{bad} must be a string, got {_short(chunks[bad])}")
        try:
            return parse_json("".join(chunks), f"{where}: attributes experiment.0..{parts - 1}")
        except InputFileError as err:
            raise ConfigError(str(err)) from None
    if "experiment" in attrs:
        if json_depth_of(attrs["experiment"]) > 64:
            raise ConfigError(f"{where}: attribute experiment nests deeper than 64 levels")
        return attrs["experiment"]
    return None


def json_depth_of(value: Any, limit: int = 65) -> int:
    """Nesting depth of a decoded JSON value, counted up to ``limit`` (never recursing past it)."""
    depth, level = 0, [value]
    while level and depth < limit:
        level = [v for x in level if isinstance(x, (dict, list))
                 for v in (x.values() if isinstance(x, dict) else x)]
        depth += 1
    return depth


def validate_settings(data: Any, where: str) -> dict[str, Any]:
    """``data`` checked as an experiment's settings: the :class:`Experiment` schema, the task's
    registered name and constructor arguments, ``n`` against the task. Returns the normalised
    settings. Nothing is imported and no task is built."""
    from dlm_toolkit.config import validate_model
    from dlm_toolkit.evaluation.evaluate import check_n
    from dlm_toolkit.sweep.experiment import Experiment
    from dlm_toolkit.tasks import TASKS

    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be an object, got {type(data).__name__}")
    try:
        exp = validate_model(Experiment, data)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    task = TASKS.get(exp.task)
    if task is None:
        raise ConfigError(f"{where}: task: unknown task {exp.task!r}; available tasks: {', '.join(sorted(TASKS))}")
    args = dict(exp.task_args)
    try:  # chat and system are options of every task (get_task takes them); the rest, the constructor's
        from dlm_toolkit.models.chat import parse_chat_mode

        parse_chat_mode(args.pop("chat", "auto"), "chat")
        if not isinstance(args.pop("system", None), (str, type(None))):
            raise ValueError("system: must be a string")
        inspect.signature(task).bind(**args)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: task_args: {err} (task {exp.task!r})") from None
    try:
        check_n(task, exp.n, split=False)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return exp.settings()


def _trial_where(trial: Any, name: str) -> str:
    return f"trial {trial.number}: attribute {name}"


def trial_policy(trial: Any) -> Any:
    """The trial's stored policy (a :class:`~dlm_toolkit.strategy.policy_config.PolicyConfig`), checked
    against its stored hash; None if it has none."""
    from dlm_toolkit.strategy.policy_config import load_policy

    text = trial.user_attrs.get("policy")
    if text is None:
        return None
    where = _trial_where(trial, "policy")
    if not isinstance(text, str) or len(text) > MAX_POLICY_CHARS:
        raise ConfigError(f"{where} must be a JSON string of at most {MAX_POLICY_CHARS} characters, got {_short(text)}")
    try:
        data = parse_json(text, where)
    except InputFileError as err:
        raise ConfigError(str(err)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(data).__name__}")
    try:
        policy = load_policy(data)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    stored_hash = trial.user_attrs.get("policy_hash", policy.config_hash())
    if stored_hash != policy.config_hash():
        raise ConfigError(f"trial {trial.number}: stored policy does not match its stored hash")
    return policy


def trial_metrics(trial: Any) -> dict[str, float]:
    """The trial's stored metrics: an object of finite-or-not numbers ({} if none)."""
    metrics = trial.user_attrs.get("metrics")
    if metrics is None:
        return {}
    if not isinstance(metrics, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in metrics.items()):
        raise ConfigError(f"{_trial_where(trial, 'metrics')} must be an object of numbers, got {_short(metrics)}")
    return {k: float(v) for k, v in metrics.items()}


def trial_outcomes(trial: Any) -> str | None:
    """The trial's per-instance outcomes as :func:`~dlm_toolkit.sweep.pareto.encode_outcomes` wrote
    them (``"<n>:<hex>"``, n at most the largest evaluation), or None."""
    from dlm_toolkit.evaluation.evaluate import MAX_GENERATED_N

    text = trial.user_attrs.get("outcomes")
    if text is None:
        return None
    match = _OUTCOMES.fullmatch(text) if isinstance(text, str) else None
    if match is None or int(match.group(1)) > MAX_GENERATED_N or len(match.group(2)) > int(match.group(1)) // 4 + 1:
        raise ConfigError(f"{_trial_where(trial, 'outcomes')} must be '<n>:<hex>' with n <= {MAX_GENERATED_N}, "
                          f"got {_short(text)}")
    return text


def trial_plugin_hashes(trial: Any) -> dict[str, str]:
    """The plug-in source hashes recorded with the trial (class path -> sha256), {} if none."""
    hashes = trial.user_attrs.get("plugin_hashes")
    if hashes is None:
        return {}
    if not isinstance(hashes, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in hashes.items()):
        raise ConfigError(f"{_trial_where(trial, 'plugin_hashes')} must be an object of strings, got {_short(hashes)}")
    return hashes


def trial_text(trial: Any, name: str) -> str | None:
    """A short string attribute of the trial (``preset``, ``policy_hash``), or None."""
    value = trial.user_attrs.get(name)
    if value is not None and (not isinstance(value, str) or len(value) > 1000):
        raise ConfigError(f"{_trial_where(trial, name)} must be a string, got {_short(value)}")
    return value
