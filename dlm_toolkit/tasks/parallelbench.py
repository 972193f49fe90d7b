"""ParallelBench (Kang et al., ICLR 2026, arXiv 2510.04767): tasks where committing several tokens
per step is provably lossy, read from a local copy of the official repository.

Data: ``dataset/parallel_bench/data/output/test/<group>/<task>.jsonl`` and the group's
``task_config.yaml`` (``prompt``, ``metric``) of github.com/furiosa-ai/ParallelBench. The repository
has no licence file, so none of its data ships here: clone it and pass its root (or its
``.../output/test`` folder) as ``--data``, or put the clone at ``$DLM_DATA_DIR/parallelbench`` or
``./data/parallelbench``. ``task`` names one task as ``group/name`` (``waiting_line/shuffle``).

Prompt, as the official evaluation builds it: each in-context example is a user turn (the task's
prompt filled with the example's input) followed by an assistant turn (the example's answer: the
string, or the ``example`` field of an answer object), then the user turn of the instance; through
the checkpoint's chat template (``chat: auto``). Without a template (``chat: false``) the same turns
are written as ``User: ...`` / ``Assistant: ...`` lines ending in ``Assistant:``. The official
"infill" variant (an output prefix with a mask per list item) is not offered.

Scores: the official lenient ``score`` (the paper's number) is ``accuracy``; the strict variant is
reported as ``accuracy_strict`` (:mod:`dlm_toolkit.tasks.parallelbench_metrics`). The Waiting Line
and Puzzle tasks are graded; the text-writing tasks (Words to Sentence, Paraphrase/Summarize) need a
grammar checker or downloaded scorers and are refused with one line naming them.
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from dlm_toolkit.config import ConfigError, read_mapping_file

from .base import Instance
from .data import DATA_ENV, DEFAULT_ROOT, BenchmarkTask, DataError, DataSource, RowSchema, read_jsonl
from .parallelbench_metrics import METRICS, TEXT_METRICS

__all__ = ["ParallelBenchTask", "REPOSITORY", "TEST_FOLDER", "fill_prompt", "render_turns"]

REPOSITORY = "https://github.com/furiosa-ai/ParallelBench"
TEST_FOLDER = Path("dataset/parallel_bench/data/output/test")
_TASK_NAME = re.compile(r"[a-z0-9_]{1,64}/[a-z0-9_]{1,64}")
MAX_PROMPT_CHARS = 20_000  # a filled prompt; the official ones are a few hundred characters


def fill_prompt(template: str, values: dict[str, Any], where: str) -> str:
    """``template.format(**values)`` for plain ``{name}`` fields only, then ``\\n`` read as a line
    break (as the official code does). A field with a conversion, a format spec, an attribute or an
    index (``{x.__class__}``, ``{x:>99999999}``) is refused: a data file must not reach objects or
    allocate without bound through a format string."""
    out = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise DataError(f"{where}: prompt is not a format string ({err})") from None
    for literal, name, spec, conversion in parsed:
        out.append(literal)
        if name is None:
            continue
        if not re.fullmatch(r"[A-Za-z_]\w*", name) or spec or conversion:
            raise DataError(f"{where}: prompt field {{{name}{'!' + conversion if conversion else ''}"
                            f"{':' + spec if spec else ''}}} is not a plain {{name}} field")
        if name not in values:
            raise DataError(f"{where}: prompt needs '{name}', which the record's input lacks")
        out.append(str(values[name]))
        if sum(map(len, out)) > MAX_PROMPT_CHARS:
            raise DataError(f"{where}: filled prompt longer than {MAX_PROMPT_CHARS} characters")
    return "".join(out).replace("\\n", "\n")


def render_turns(messages: Sequence[dict[str, str]]) -> str:
    """The turns as plain text for a model without a chat template."""
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    return "".join(f"{names[m['role']]}: {m['content'].strip()}\n" for m in messages) + "Assistant:"


class ParallelBenchTask(BenchmarkTask):
    """One ParallelBench task from a local clone of the official repository.

    Args:
        task: ``group/name``, e.g. ``waiting_line/shuffle``, ``puzzle/latin_square_n4``.
        data: the repository's root or its ``dataset/parallel_bench/data/output/test`` folder.
        answer_length: generation budget in tokens (default 96: the longest Waiting Line answer,
            six full names in a JSON list, is ~40 tokens with a BPE vocabulary).
    """

    name = "parallelbench"
    description = "ParallelBench list and puzzle tasks (official prompts and metrics), from a local clone"
    metric_name = "accuracy"
    source = DataSource(folder="parallelbench", filename="task_config.yaml",
                        fetch=f"git clone {REPOSITORY} data/parallelbench",
                        licence="none stated (the repository has no licence file, so none of its data ships here)")
    stop = ("</s>", "<|im_end|>", "<|endoftext|>")

    class Record(RowSchema):
        """A line of a ParallelBench test file."""

        input: dict[str, Any]
        answer: str | dict[str, Any]
        metadata: dict[str, Any] = Field(default_factory=dict)

    def __init__(self, task: str = "waiting_line/shuffle", data: str | Path | None = None,
                 answer_length: int = 96) -> None:
        if not isinstance(task, str) or not _TASK_NAME.fullmatch(task):
            raise ConfigError(f"task: must be 'group/name' in lower-case letters, digits and '_' "
                              f"(e.g. waiting_line/shuffle), got {task!r}")
        self.task = task
        super().__init__(self._folder(data) / task.split("/")[0], answer_length)

    def _folder(self, data: str | Path | None) -> Path:
        """The ``output/test`` folder: under ``data`` (the repository root, or the folder itself),
        else under ``$DLM_DATA_DIR/parallelbench`` or ``./data/parallelbench``."""
        if data is not None and str(data) != "":
            root, where = Path(data).expanduser(), "--data"
        else:
            base = os.environ.get(DATA_ENV) or DEFAULT_ROOT
            root = Path(base).expanduser() / self.source.folder
            where = f"${DATA_ENV}/parallelbench" if os.environ.get(DATA_ENV) else "./data/parallelbench"
        for folder in (root / TEST_FOLDER, root):
            if (folder / self.task.split("/")[0]).is_dir():
                return folder
        raise DataError(
            f"task 'parallelbench': no ParallelBench test data for '{self.task}' under {root} ({where}); it is "
            f"read from a clone of {REPOSITORY} (folder {TEST_FOLDER}/<group>/; no licence file, so not shipped): "
            f"git clone {REPOSITORY} data/parallelbench, or pass --data PATH_TO_CLONE")

    def _load(self, path: Path) -> list[Instance]:
        group, name = self.task.split("/")
        configs = read_mapping_file(path)
        config = configs.get(self.task)
        if not isinstance(config, dict):
            known = sorted(k for k in configs if isinstance(k, str))
            raise DataError(f"{path}: no task '{self.task}' (this group has: {', '.join(known)})")
        metric, prompt = config.get("metric"), config.get("prompt")
        if not isinstance(prompt, str) or not isinstance(metric, str):
            raise DataError(f"{path}: task '{self.task}' needs a string 'prompt' and 'metric'")
        if metric in TEXT_METRICS:
            raise DataError(f"parallelbench task '{self.task}': its official metric '{metric}' needs "
                            f"{TEXT_METRICS[metric]}, which dlm-toolkit does not run; the Waiting Line and "
                            "Puzzle tasks are graded here")
        if metric not in METRICS:
            raise DataError(f"{path}: task '{self.task}' has metric '{metric}', which is not one of "
                            f"{', '.join(sorted(METRICS))}")
        self.metric = metric
        out = []
        for row in read_jsonl(path.parent / f"{name}.jsonl", self.Record):
            record = row.data
            messages = []
            for k, example in enumerate(record["input"].get("icl_examples") or []):
                if not isinstance(example, dict) or not isinstance(example.get("input"), dict):
                    raise DataError(f"{row.where}: icl_examples[{k}] needs an 'input' object")
                shown = example.get("answer")
                shown = shown.get("example") if isinstance(shown, dict) else shown
                if not isinstance(shown, str):
                    raise DataError(f"{row.where}: icl_examples[{k}] needs an answer string (or 'example')")
                messages += [{"role": "user", "content": fill_prompt(prompt, example["input"], row.where)},
                             {"role": "assistant", "content": shown}]
            messages.append({"role": "user", "content": fill_prompt(prompt, record["input"], row.where)})
            answer = record["answer"]
            self._check_answer(answer, row.where)
            shown = answer.get("example", "") if isinstance(answer, dict) else answer
            out.append(Instance(prompt=render_turns(messages), reference=str(shown),
                                meta={"index": row.index, "where": row.where, "answer": answer,
                                      "messages": messages, "length": record["metadata"].get("length")}))
        return out

    def _check_answer(self, answer: Any, where: str) -> None:
        """The answer fields the task's metric reads, with their types (a string where a list belongs
        would be iterated character by character)."""
        needs: dict[str, Any] = {
            "list_shuffle_score": {"input": list},
            "list_random_insert_score": {"input": list, "word": (str, list, type(None))},
            "list_random_remove_score": {"input": list},
            "list_random_replace_score": {"input": list, "word": (str, type(None))},
            "latin_square_score": {"symbols": list},
        }.get(self.metric, {})
        if not needs:
            if not isinstance(answer, str):
                raise DataError(f"{where}: metric '{self.metric}' needs the answer as a string")
            return
        if not isinstance(answer, dict):
            raise DataError(f"{where}: metric '{self.metric}' needs the answer as an object")
        for key, kind in needs.items():
            if key not in answer or not isinstance(answer[key], kind):
                raise DataError(f"{where}: answer field '{key}' missing or of the wrong type for '{self.metric}'")
            if kind is list and not all(isinstance(v, str) for v in answer[key]):
                raise DataError(f"{where}: answer field '{key}' must be a list of strings")
        n_words = answer.get("n_words", 1)
        if isinstance(n_words, bool) or not isinstance(n_words, int) or n_words < 1:
            raise DataError(f"{where}: answer field 'n_words' must be an integer >= 1")

    def chat_messages(self, instance: Instance) -> list[dict[str, str]]:
        """The conversation (in-context turns, then the instance's) for the chat template."""
        return list(instance.meta["messages"])

    def score(self, instance: Instance, completion: str) -> float:
        return METRICS[self.metric](completion, instance.meta["answer"], False)

    def extra_metrics(self, instances: Sequence[Instance], scores: Sequence[float],
                      completions: Sequence[str] = ()) -> dict[str, float]:
        """``accuracy_strict``: the official strict score (a list written exactly as ``["a", "b"]``, a
        Sudoku as four lines of four digits), the paper's second number."""
        if not completions:
            return {}
        strict = [METRICS[self.metric](c, i.meta["answer"], True) for i, c in zip(instances, completions)]
        return {"accuracy_strict": sum(strict) / len(strict)}

    def __repr__(self) -> str:
        return f"ParallelBenchTask(task={self.task!r}, path={str(self.path)!r})"
