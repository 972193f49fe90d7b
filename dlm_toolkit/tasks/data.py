"""Benchmark data from local files: where a task looks, how a file is read, and the base class of
the benchmark tasks (GSM8K, GSM-Plus, MATH-500, MBPP, HumanEval+, MBPP+).

Nothing is downloaded at run time. A task reads its benchmark, in the benchmark's official file
format, from the first of:

1. the task's ``data`` argument (``dlm eval --data PATH``; ``task_args: {data: PATH}`` in an
   experiment): a file, or a folder holding the file under its official name;
2. ``$DLM_DATA_DIR/<task folder>/<file>`` (:data:`DATA_ENV`);
3. ``./data/<task folder>/<file>`` (relative to the working folder).

A missing file is one line naming the task, the path looked at and the one-line command that puts
the file there (``README.md``, "Reproduce the paper", lists them with their licences). Files are
read as config files are (:func:`read_data_text`: regular files only -- a FIFO, a device or a
``/proc`` file is refused by name, never opened for reading --, a size limit, JSON nesting at most
:data:`~dlm_toolkit.util.files.MAX_JSON_DEPTH` deep) and every record is checked by its task's
:class:`RowSchema` (strict types: MBPP's ``test_imports`` is a list of strings, never a string). A
bad record is one line naming the file, the line and the field.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import MAX_JSON_DEPTH, InputFileError, check_regular, json_depth, parse_json, read_text

from .base import Instance, Split, Task, _check_args

__all__ = ["DATA_ENV", "BenchmarkTask", "DataError", "DataSource", "FiniteNumber", "Row", "RowSchema", "fixed_subset",
           "read_data_text", "read_json_records", "read_jsonl", "resolve_data"]

DATA_ENV = "DLM_DATA_DIR"
DEFAULT_ROOT = "data"
MAX_DATA_BYTES = 512 << 20  # far above any of these benchmarks (HumanEval+ is ~70 MB): a sanity cap


class DataError(ConfigError):
    """A benchmark file is missing or malformed (the CLI exits 2 with the message)."""


@dataclass(frozen=True)
class DataSource:
    """Where a benchmark's file lives upstream and locally.

    Attributes:
        folder: sub-folder of the data root (``$DLM_DATA_DIR`` or ``./data``).
        filename: the file's official name.
        fetch: the one-line shell command that puts it in place under the default root.
        licence: the data's licence, as its publisher states it.
    """

    folder: str
    filename: str
    fetch: str
    licence: str


def resolve_data(task: str, source: DataSource, data: str | Path | None) -> Path:
    """The benchmark file ``task`` reads (see the module docstring for the order).

    Raises:
        DataError: no file there (the message names the path and the command that puts it
            there), or something that is not a regular file of at most :data:`MAX_DATA_BYTES`
            (a FIFO, a device, a socket: named as such, never read).
    """
    if data is not None and str(data) != "":
        path = Path(data).expanduser()
        if path.is_dir():
            path = path / source.filename
        where = "data"
    else:
        root = os.environ.get(DATA_ENV) or DEFAULT_ROOT
        path = Path(root).expanduser() / source.folder / source.filename
        where = f"${DATA_ENV}" if os.environ.get(DATA_ENV) else f"default data folder ./{DEFAULT_ROOT}"
    if not os.path.exists(path):
        raise DataError(f"task '{task}': no data file at {path} ({where}); put it there with: {source.fetch} "
                        f"(licence: {source.licence}), or pass --data PATH")
    try:
        check_regular(path, MAX_DATA_BYTES, f"task '{task}''s data file")
    except InputFileError as err:
        raise DataError(str(err)) from None
    return path


class RowSchema(BaseModel):
    """Base of a benchmark's row schema: the fields a task reads, strictly typed (a string where
    a list belongs is refused, never iterated); other fields of the official files are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


FiniteNumber = Annotated[Union[int, float], Field(allow_inf_nan=False)]


@dataclass(frozen=True)
class Row:
    """One record of a benchmark file: ``where`` is ``PATH:LINE`` (for messages), ``index`` its
    0-based position among the records, ``data`` its fields (validated by the task's schema)."""

    where: str
    index: int
    data: dict[str, Any]


def read_data_text(path: Path) -> str:
    """The text of a benchmark file, through the same bounded reader as config files: a regular
    file of 1 .. :data:`MAX_DATA_BYTES` bytes, UTF-8. A file whose size reads as 0 is refused
    before reading: empty, or a ``/proc``/``/sys`` pseudo-file (``/proc/self/pagemap`` would
    read without end)."""
    try:
        size = check_regular(path, MAX_DATA_BYTES, "a benchmark data file")
        if size == 0:
            raise DataError(f"{path}: a benchmark data file of size 0 (empty, or a /proc or /sys file that is "
                            "never read): no records")
        return read_text(path, size, "a benchmark data file")  # refused if it grew past its size since
    except InputFileError as err:
        raise DataError(str(err)) from None


def _check_fields(record: Any, schema: type[RowSchema] | Sequence[str], where: str) -> dict[str, Any]:
    """``record`` if it is an object with every required field, valid under ``schema`` (a
    :class:`RowSchema`; a plain sequence of field names checks presence only)."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(record).__name__}")
    typed = isinstance(schema, type) and issubclass(schema, BaseModel)
    required = [n for n, f in schema.model_fields.items() if f.is_required()] if typed else list(schema)
    missing = [f for f in required if f not in record]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(repr(m) for m in missing)} "
                        f"(a record needs {', '.join(required)})")
    if not typed:
        return record
    try:
        schema.model_validate(record)
    except ValidationError as err:
        e = err.errors()[0]  # a union's member tags ('answer.str') are left out of the field's path
        field = ".".join(str(p) for p in e["loc"] if isinstance(p, int) or p in schema.model_fields)
        raise DataError(f"{where}: field '{field}': {e['msg']} (got {type(e['input']).__name__} "
                        f"{_short(e['input'])})") from None
    return record


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_jsonl(path: Path, schema: type[RowSchema]) -> list[Row]:
    """One JSON object per line (blank lines skipped), each valid under ``schema``.

    Raises:
        DataError: ``PATH:LINE: ...`` for the first record that is not JSON, nests deeper than
            :data:`~dlm_toolkit.util.files.MAX_JSON_DEPTH`, lacks a field or has one of the wrong type.
    """
    rows = []
    for number, line in enumerate(read_data_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = parse_json(line, where)
        except InputFileError as err:
            raise DataError(f"{err} (a JSON line)") from None
        rows.append(Row(where, len(rows), _check_fields(record, schema, where)))
    if not rows:
        raise DataError(f"{path}: no records (expected one JSON object per line)")
    return rows


_WS = re.compile(r"[ \t\n\r]*")


def read_json_records(path: Path, schema: type[RowSchema]) -> list[Row]:
    """A JSON array of objects, each valid under ``schema`` (MBPP's ``sanitized-mbpp.json``);
    each record's ``where`` names the line it starts on.

    Raises:
        DataError: not JSON, nested too deep, not a non-empty array, or ``PATH:LINE: record I:
            ...`` for the first record that lacks a field or has one of the wrong type.
    """
    text = read_data_text(path)
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise DataError(f"{path}: JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    decoder = json.JSONDecoder()
    i = _WS.match(text).end()
    if not text.startswith("[", i):
        try:
            data = parse_json(text, str(path))
        except InputFileError as err:
            raise DataError(str(err)) from None
        raise DataError(f"{path}: expected a non-empty JSON array of records, found {type(data).__name__}")
    i, line, at, rows = _WS.match(text, i + 1).end(), 1, 0, []
    try:
        while not text.startswith("]", i):
            line += text.count("\n", at, i)
            at = i
            record, i = decoder.raw_decode(text, i)
            where = f"{path}:{line}: record {len(rows)}"
            rows.append(Row(where, len(rows), _check_fields(record, schema, where)))
            i = _WS.match(text, i).end()
            if text.startswith(",", i):
                i = _WS.match(text, i + 1).end()
            elif not text.startswith("]", i):
                raise json.JSONDecodeError("expected ',' or ']'", text, i)
        if _WS.match(text, i + 1).end() != len(text):
            raise json.JSONDecodeError("extra data after the array", text, i + 1)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not a JSON file ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not rows:
        raise DataError(f"{path}: expected a non-empty JSON array of records, found an empty one")
    return rows


def fixed_subset(items: Sequence[Instance], n: int, seed: int, split: Split, name: str) -> list[Instance]:
    """``n`` eval instances of a fixed set: all of them in order when ``n`` covers the set, else a
    subset drawn with ``seed`` (kept in order). Evaluation-only sets refuse ``split="train"``."""
    _check_args(n, split)
    if split != "eval":
        raise ValueError(f"{name} is evaluation-only: use split='eval'")
    if n >= len(items):
        return list(items)
    chosen = sorted(random.Random(f"{name}|{seed}").sample(range(len(items)), n))
    return [items[i] for i in chosen]


class BenchmarkTask(Task):
    """A fixed evaluation set read from a local file; evaluation-only (no train split).

    Subclasses set :attr:`source`, implement :meth:`_load` (file -> instances, validated) and
    :meth:`score`. ``n`` at most the set's size: the whole set in file order when ``n`` covers
    it, else a subset drawn with ``seed`` (kept in file order), as for ``humaneval``.

    Args:
        data: a file or folder to read (default: ``$DLM_DATA_DIR``/``./data``; see module doc).
        answer_length: generation budget in tokens (``gen_length`` is this + 1).
    """

    source: ClassVar[DataSource]
    metric_name = "accuracy"

    def __init__(self, data: str | Path | None = None, answer_length: int = 256) -> None:
        if isinstance(answer_length, bool) or not isinstance(answer_length, int) or answer_length <= 0:
            raise ConfigError(f"answer_length: must be an integer >= 1 (got {answer_length!r})")
        self.answer_length = answer_length
        self.path = resolve_data(self.name, self.source, data)
        self._instances = self._load(self.path)
        if not self._instances:
            raise DataError(f"task '{self.name}': {self.path} holds no usable instances")
        self.eval_size = len(self._instances)

    def _load(self, path: Path) -> list[Instance]:
        raise NotImplementedError

    def instances(self, n: int, seed: int, split: Split) -> list[Instance]:
        return fixed_subset(self._instances, n, seed, split, self.name)

    def _sample(self, rng: random.Random, split: Split) -> Instance | None:
        return rng.choice(self._instances)

    def split_of(self, instance: Instance) -> Split:
        return "eval"

    def chance_score(self, n: int = 500, seed: int = 0) -> float:
        """0.0: not measured (random text essentially never solves these benchmarks)."""
        return 0.0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={str(self.path)!r}, answer_length={self.answer_length})"
