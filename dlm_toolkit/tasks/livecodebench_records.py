"""LiveCodeBench records, read as hostile data: test lists, the encoded private tests and the fields
:class:`~dlm_toolkit.tasks.livecodebench.LiveCodeBenchTask` checks, each refusal one line naming
``FILE:LINE`` and the question id. Kept apart from the task (prompts, grading), which re-exports
the public names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import MAX_JSON_DEPTH, json_depth

from .data import DataError
from .safe_pickle import UnsafeBlob, decode_blob

MAX_TESTS = 10_000
"""Most tests one problem may have, public and private together (the official problems have tens to a few
hundred); checked before any test is parsed, so a record of a million tests is one line, not minutes."""
MAX_ARGS = 100
"""Most arguments (input lines) of one call-based test (LeetCode methods take a handful): each is parsed
on its own, so a megabyte of one-character lines would otherwise cost seconds per test."""


@dataclass(frozen=True)
class _Where:
    path: Path
    line: int
    question_id: str | None = None

    def error(self, field: str, what: str) -> DataError:
        qid = "" if self.question_id is None else f"question {self.question_id[:100]!r}: "
        return DataError(f"{self.path}:{self.line}: {qid}field '{field}': {what}")


def parse_tests(value: Any, where: _Where, field: str, func_name: str | None,
                room: int = MAX_TESTS) -> list[tuple[Any, Any]]:
    """``[(input, output)]`` from a decoded test list: ``(stdin, stdout)`` strings, or for a
    call-based problem ``(argument list, expected value)`` (each input line one JSON argument).
    At most ``room`` tests (what :data:`MAX_TESTS` leaves after the problem's other tests).

    Raises:
        DataError: naming ``where`` and ``field``.
    """
    if not isinstance(value, list):
        raise where.error(field, f"must be a list of tests, found {type(value).__name__}")
    if len(value) > room:
        raise where.error(field, f"{MAX_TESTS - room + len(value)} tests, public and private together; a problem "
                                 f"may have at most {MAX_TESTS}")
    out = []
    for k, test in enumerate(value):
        if not isinstance(test, dict) or not isinstance(test.get("input"), str) or \
                not isinstance(test.get("output"), str) or test.get("testtype") not in ("stdin", "functional"):
            raise where.error(field, f"test {k} must be {{input: str, output: str, testtype: 'stdin'|'functional'}}")
        if func_name is None:
            out.append((test["input"], test["output"]))
            continue
        lines = test["input"].split("\n", MAX_ARGS)
        if len(lines) > MAX_ARGS:
            raise where.error(field, f"test {k} of a call-based problem has more than {MAX_ARGS} input lines (one "
                                     "JSON argument each)")
        try:
            args = [_json(line) for line in lines]
            expected = _json(test["output"])
        except json.JSONDecodeError as exc:
            raise where.error(field, f"test {k} of a call-based problem: an input line or the output is not "
                                     f"JSON ({exc.msg})") from None
        out.append((args, expected))
    return out


def _json(text: str) -> Any:
    """``json.loads`` with the shared depth bound: the JSON strings inside a record's fields (metadata,
    tests, their inputs) are not seen by the line's own depth check, and json recurses per level."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise json.JSONDecodeError(f"nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted", text, 0)
    try:  # NaN, Infinity or 1e999 cannot cross the sandbox boundary nor equal anything: an unsolvable test
        return json.loads(text, parse_constant=_not_finite, parse_float=_finite_float)
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # an integer past Python's 4300 digits (its message says so), or not finite
        raise json.JSONDecodeError(str(exc).split(";")[0], text, 0) from None


def _not_finite(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text[:30]} is not a finite number")
    return value


def _loads(text: str, where: _Where, field: str, what: str = "not JSON") -> Any:
    try:
        return _json(text)
    except json.JSONDecodeError as exc:
        raise where.error(field, f"{what} ({exc.msg} at column {exc.colno})") from None


def _json_field(record: dict[str, Any], field: str, where: _Where) -> Any:
    text = record[field]
    if not isinstance(text, str):
        raise where.error(field, f"must be a JSON string, found {type(text).__name__}")
    return _loads(text, where, field)


def decode_private(text: Any, where: _Where, max_bytes: int) -> Any:
    """The private tests' list: a JSON string as is, else ``base64(zlib(pickle(JSON string)))``
    decoded without unpickling objects (official order: JSON first).

    Raises:
        DataError: naming ``where`` and the field, with what is wrong (base64, zlib, pickle, size, JSON).
    """
    field = "private_test_cases"
    if not isinstance(text, str):
        raise where.error(field, f"must be a string, found {type(text).__name__}")
    try:
        return _json(text)
    except json.JSONDecodeError:
        pass
    try:
        inner = decode_blob(text, max_bytes)
    except UnsafeBlob as exc:
        raise where.error(field, f"neither JSON nor base64+zlib+pickle of plain data: {exc}") from None
    if isinstance(inner, bytes):
        inner = inner.decode("utf-8", "replace")
    if not isinstance(inner, str):
        raise where.error(field, f"the pickle must hold a JSON string, found {type(inner).__name__}")
    return _loads(inner, where, field, "the pickled string is not JSON")


def _choice(record: dict[str, Any], field: str, allowed: Sequence[str], where: _Where) -> str:
    value = record[field]
    if value not in allowed:
        raise where.error(field, f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _date(text: str | None, option: str) -> datetime | None:
    if text is None or text == "":
        return None
    try:
        return datetime.strptime(str(text), "%Y-%m-%d")
    except ValueError:
        raise ConfigError(f"{option}: {text!r} is not a date YYYY-MM-DD") from None
