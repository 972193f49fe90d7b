"""GSM8K and GSM-Plus: grade-school math word problems, scored as lm-evaluation-harness scores them.

Data: GSM8K's ``test.jsonl`` (``question``, ``answer`` ending in ``#### N``); GSM-Plus's
``gsmplus_testmini.jsonl`` (``question``, ``answer`` = the number, ``perturbation_type``; its
"critical thinking" items have no numeric answer and are left out unless asked for).

Scoring follows lm-eval's ``gsm8k`` task (v3):

* **strict** (``strict-match``): the first ``#### N`` in the completion (regex
  ``#### (\\-?[0-9\\.\\,]+)``);
* **flexible** (``flexible-extract``, the default here): the *last* number-like span
  (``(-?[$0-9.,]{2,})|(-?[0-9]+)``);

no match gives ``[invalid]``. The extracted string and the reference are compared by lm-eval's
``exact_match`` with its ``regexes_to_ignore`` (``,``, ``$``, everything up to ``#### ``, one
trailing ``.``; its ``ignore_case`` cannot matter for these patterns). ``tests/test_benchmarks.py`` checks these decisions against
lm-eval's own filter and metric.

Prompt: raw (base models) ``Question: {question}\\nAnswer:`` (lm-eval's zero-shot format), stop
strings ``Question:``, ``</s>``, ``<|im_end|>``; through a chat template the user turn asks for the
reasoning and a last line ``#### N``, so both matches apply to instruct models too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from dlm_toolkit.config import ConfigError

from .base import Instance, bool_option
from .data import BenchmarkTask, DataError, DataSource, FiniteNumber, RowSchema, read_jsonl

__all__ = ["FLEXIBLE", "GSM8KTask", "GSMPlusTask", "STRICT", "extract_answer", "gsm8k_match", "reference_answer"]

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
INVALID = "[invalid]"
_IGNORE = (re.compile(","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$"))
STOP = ("Question:", "</s>", "<|im_end|>")
CHAT_INSTRUCTION = ("{question}\nSolve the problem step by step. On the last line, write the final answer as "
                    "'#### N', where N is a number.")

Match = Literal["strict", "flexible"]


def extract_answer(completion: str, match: Match = "flexible") -> str:
    """The answer string lm-eval's ``strict-match`` / ``flexible-extract`` filter takes from a
    completion (``[invalid]`` when nothing matches)."""
    if match == "strict":
        found = STRICT.findall(completion)
        return found[0].strip() if found else INVALID
    found = FLEXIBLE.findall(completion)
    if not found:
        return INVALID
    groups = [g for g in found[-1] if g]  # the last match; the first group that matched
    return groups[0].strip() if groups else INVALID


def _normalise(text: str) -> str:
    # lm-eval also lowercases (ignore_case), which cannot change a match here: both extraction
    # patterns only ever return digits, '-', '.', ',', '$' or '[invalid]'
    for pattern in _IGNORE:
        text = pattern.sub("", text)
    return text


def gsm8k_match(completion: str, reference: str, match: Match = "flexible") -> bool:
    """lm-eval's exact match of the extracted answer against the reference (the full GSM8K
    answer with its ``#### N``, or the bare number)."""
    return _normalise(extract_answer(completion, match)) == _normalise(reference)


_NUMBER = re.compile(r"-?[0-9][0-9,]*(\.[0-9]+)?")
"""A reference's final answer: GSM8K writes integers, some with thousands commas; GSM-Plus also decimals."""


def reference_answer(answer: str) -> str:
    """The final number of a GSM8K solution (text after ``#### ``)."""
    return answer.split("####")[-1].strip()


class GSM8KTask(BenchmarkTask):
    """GSM8K test set (1319 problems) from a local ``test.jsonl``.

    Args:
        data: file or folder (see :mod:`dlm_toolkit.tasks.data`).
        answer_length: generation budget in tokens (default 256, as the LLaDA2.x reports' math
            settings; raise it for long chains of thought).
        match: ``flexible`` (default) or ``strict`` (see the module docstring).
    """

    name = "gsm8k"
    description = "GSM8K grade-school math (lm-eval strict/flexible match), from a local test.jsonl"
    metric_name = "exact_match"
    source = DataSource(
        folder="gsm8k", filename="test.jsonl",
        fetch="mkdir -p data/gsm8k && curl -fL -o data/gsm8k/test.jsonl "
              "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/test.jsonl",
        licence="MIT (openai/grade-school-math)",
    )
    stop = STOP

    def __init__(self, data: str | Path | None = None, answer_length: int = 256, match: Match = "flexible") -> None:
        if match not in ("strict", "flexible"):
            raise ConfigError(f"match: must be 'strict' or 'flexible' (got {match!r})")
        self.match: Match = match
        super().__init__(data, answer_length)

    class Record(RowSchema):
        """A line of GSM8K's ``test.jsonl``: the solution ends in ``#### N``."""

        question: str
        answer: str

    def _load(self, path: Path) -> list[Instance]:
        out = []
        for row in read_jsonl(path, self.Record):
            i, r = row.index, row.data
            if "####" not in r["answer"]:
                raise DataError(f"{row.where}: record {i}: 'answer' has no '#### N' final answer")
            final = reference_answer(r["answer"])
            if not _NUMBER.fullmatch(final):  # NaN would match a completion that says NaN
                raise DataError(f"{row.where}: record {i}: 'answer' ends in '#### {final[:40]}', not a number "
                                "(digits, commas, an optional sign and decimals)")
            out.append(self._instance(r["question"], r["answer"], {"index": i}))
        return out

    @staticmethod
    def _instance(question: str, answer: str, meta: dict[str, Any]) -> Instance:
        return Instance(prompt=f"Question: {question}\nAnswer:", reference=answer,
                        meta={**meta, "chat_prompt": CHAT_INSTRUCTION.format(question=question)})

    def canonical_key(self, instance: Instance) -> str:
        return instance.prompt

    def score(self, instance: Instance, completion: str) -> float:
        return float(gsm8k_match(completion, instance.reference, self.match))


class GSMPlusTask(GSM8KTask):
    """GSM-Plus (perturbed GSM8K problems), scored exactly as :class:`GSM8KTask`.

    Args:
        critical_thinking: keep the "critical thinking" items (reference ``None``: the problem
            lacks information; they pass only if the extracted answer is literally ``None``,
            which the number matches never yield). Default: left out, as numeric-answer scoring
            cannot judge them.
    """

    name = "gsm_plus"
    description = "GSM-Plus perturbed math word problems (lm-eval GSM8K matching), from a local jsonl"
    source = DataSource(
        folder="gsm_plus", filename="gsmplus_testmini.jsonl",
        fetch="mkdir -p data/gsm_plus && curl -fL -o data/gsm_plus/gsmplus_testmini.jsonl "
              "https://raw.githubusercontent.com/qtli/GSM-Plus/main/dataset/gsmplus_testmini.jsonl",
        licence="see the qtli/GSM-Plus repository (CC BY-SA 4.0 per its dataset card)",
    )

    def __init__(self, data: str | Path | None = None, answer_length: int = 256, match: Match = "flexible",
                 critical_thinking: bool = False) -> None:
        self.critical_thinking = bool_option(self.name, "critical_thinking", critical_thinking)
        super().__init__(data, answer_length, match)

    class Record(RowSchema):
        """A line of ``gsmplus_testmini.jsonl`` (the answer: a number, or "None")."""

        question: str
        answer: str | FiniteNumber
        perturbation_type: str

    def _load(self, path: Path) -> list[Instance]:
        out = []
        for row in read_jsonl(path, self.Record):
            i, r = row.index, row.data
            answer = str(r["answer"]).strip()
            if answer == "None" and not self.critical_thinking:
                continue
            if answer.lower().lstrip("+-") in ("nan", "inf", "infinity"):  # a completion saying so would match
                raise DataError(f"{row.where}: record {i}: 'answer' {answer!r} is not a finite number nor 'None'")
            out.append(self._instance(str(r["question"]), answer,
                                      {"index": i, "perturbation_type": str(r["perturbation_type"])}))
        return out
