"""MATH-500 (the PRM800K test split of the MATH benchmark): the last ``\\boxed{...}`` answer,
normalised and compared for equivalence.

Data: PRM800K's ``prm800k/math_splits/test.jsonl`` (``problem``, ``solution``, ``answer``,
``subject``, ``level``, ``unique_id``).

Verifier (the MATH benchmark's convention, as in Hendrycks et al.'s ``is_equiv``): take the
content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in the completion; no box, no answer.
Both it and the reference answer are normalised: line breaks and ``\\!`` removed, ``\\\\`` read
as ``\\``, ``tfrac``/``dfrac`` as ``frac``, ``\\left``/``\\right``, degree marks, ``\\$``,
dollar signs, a trailing ``\\text{ unit}``, percent signs removed, a leading ``x =`` (a short
variable name) dropped, ``.5`` read as ``0.5``, ``\\sqrt2`` as ``\\sqrt{2}``, ``\\frac12`` as
``\\frac{1}{2}``, ``a/b`` of two integers as ``\\frac{a}{b}``, ``0.5`` as ``\\frac{1}{2}``, spaces
dropped. Equal normalised strings are equivalent; so are two plain numbers that agree to 1e-9.
"""

from __future__ import annotations

import re
from pathlib import Path

from .base import Instance
from .data import BenchmarkTask, DataSource, FiniteNumber, RowSchema, read_jsonl

__all__ = ["Math500Task", "is_equiv", "last_boxed", "normalise_answer"]

CHAT_INSTRUCTION = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or of a
    ``\\boxed x`` without braces; None when there is none or its braces never close."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed "):
        return rest[len("\\boxed "):].split("$")[0].strip()
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[open_at + 1 : i]
    return None


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        if b == "{":  # \frac1{2}
            out += "{" + a + "}" + part[1:]
        else:
            out += "{" + a + "}{" + b + "}" + rest
    return out


def _fix_slash(s: str) -> str:
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def normalise_answer(s: str) -> str:
    """The MATH normal form of an answer string (see the module docstring)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s[^}]*\}$", "", s)  # a trailing unit: "5 \text{ cm}"
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs.strip()) <= 2:
        s = rhs
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_slash(s)


def _number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def is_equiv(a: str | None, b: str | None) -> bool:
    """Whether two answers are the same after normalisation (numbers: within 1e-9)."""
    if a is None or b is None:
        return False
    na, nb = normalise_answer(a), normalise_answer(b)
    if na == nb:
        return True
    xa, xb = _number(na), _number(nb)
    return xa is not None and xb is not None and abs(xa - xb) <= 1e-9 * max(1.0, abs(xb))


class Math500Task(BenchmarkTask):
    """MATH-500 from a local PRM800K ``test.jsonl``; answer in the last ``\\boxed{}``.

    Args:
        data: file or folder (see :mod:`dlm_toolkit.tasks.data`).
        answer_length: generation budget in tokens (default 512).
    """

    name = "math500"
    description = "MATH-500 competition math (last \\boxed{} answer, normalised equivalence), from a local jsonl"
    metric_name = "accuracy"
    source = DataSource(
        folder="math500", filename="test.jsonl",
        fetch="mkdir -p data/math500 && curl -fL -o data/math500/test.jsonl "
              "https://raw.githubusercontent.com/openai/prm800k/main/prm800k/math_splits/test.jsonl",
        licence="MIT (openai/prm800k; the MATH problems: MIT, hendrycks/math)",
    )
    stop = ("Problem:", "</s>", "<|im_end|>")

    def __init__(self, data: str | Path | None = None, answer_length: int = 512) -> None:
        super().__init__(data, answer_length)

    class Record(RowSchema):
        """A line of PRM800K's MATH-500 ``test.jsonl``."""

        problem: str
        answer: str | FiniteNumber
        unique_id: str | None = None

    def _load(self, path: Path) -> list[Instance]:
        out = []
        for row in read_jsonl(path, self.Record):
            i, r = row.index, row.data
            problem = r["problem"]
            out.append(Instance(prompt=f"Problem: {problem}\nSolution:", reference=str(r["answer"]),
                                meta={"index": i, "unique_id": r.get("unique_id", str(i)),
                                      "chat_prompt": CHAT_INSTRUCTION.format(problem=problem)}))
        return out

    def score(self, instance: Instance, completion: str) -> float:
        return float(is_equiv(last_boxed(completion), instance.reference))
