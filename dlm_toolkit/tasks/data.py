"""Benchmark data from local files: where a task looks, how a file is read, and the base class of
the benchmark tasks (GSM8K, GSM-Plus, MATH-500, MBPP, HumanEval+, MBPP+).

Nothing is downloaded at run time. A task reads its benchmark, in the benchmark's official file
format, from the first of:

1. the task's ``data`` argument (``dlm eval --data PATH``; ``task_args: {data: PATH}`` in an
   experiment): a file, or a folder holding the file under its official name;
2. ``$DLM_DATA_DIR/<task folder>/<file>`` (:data:`DATA_ENV`);
3. ``./data/<task folder>/<file>`` (relative to the working folder).

A missing file is one line naming the task, the path looked at and the one-line command that puts
the file there (``README.md``, "Reproduce the paper", lists them with their licences). A file of
the wrong format names the line (JSONL) or the record (JSON) and the field.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

from dlm_toolkit.config import ConfigError

from .base import Instance, Split, Task, _check_args

__all__ = ["DATA_ENV", "BenchmarkTask", "DataError", "DataSource", "fixed_subset", "read_json_records", "read_jsonl",
           "resolve_data"]

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
        DataError: no file there; the message names the path and the command that puts it there.
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
    if not path.is_file():
        raise DataError(f"task '{task}': no data file at {path} ({where}); put it there with: {source.fetch} "
                        f"(licence: {source.licence}), or pass --data PATH")
    size = path.stat().st_size
    if size > MAX_DATA_BYTES:
        raise DataError(f"task '{task}': {path} is {size} bytes, more than the {MAX_DATA_BYTES} a benchmark file may have")
    return path


def _check_fields(record: Any, required: Sequence[str], where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(record).__name__}")
    missing = [f for f in required if f not in record]
    if missing:
        raise DataError(f"{where}: missing field(s) {', '.join(repr(m) for m in missing)} "
                        f"(a record needs {', '.join(required)})")
    return record


def read_jsonl(path: Path, required: Sequence[str]) -> list[dict[str, Any]]:
    """One JSON object per line (blank lines skipped), each with the ``required`` fields.

    Raises:
        DataError: naming the line of the first record that is not JSON or lacks a field.
    """
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{number}: not a JSON line ({e.msg} at column {e.colno})") from None
            records.append(_check_fields(record, required, f"{path}:{number}"))
    if not records:
        raise DataError(f"{path}: no records (expected one JSON object per line)")
    return records


def read_json_records(path: Path, required: Sequence[str]) -> list[dict[str, Any]]:
    """A JSON array of objects, each with the ``required`` fields (MBPP's ``sanitized-mbpp.json``).

    Raises:
        DataError: not JSON, not an array, or naming the first record that lacks a field.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not a JSON file ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, list) or not data:
        raise DataError(f"{path}: expected a non-empty JSON array of records, found {type(data).__name__}")
    return [_check_fields(r, required, f"{path}: record {i}") for i, r in enumerate(data)]


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
