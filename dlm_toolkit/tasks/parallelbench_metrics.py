"""ParallelBench's metrics for the Waiting Line and Puzzle groups, written from their definitions.

Each metric takes the decoded prediction and the record's ``answer`` field and returns 0.0 or 1.0;
``strict=True`` is the official "strict" variant (a list must be written exactly as
``["a", "b"]``; a Sudoku as four lines of four digits). The official evaluation reports both,
as percentages: ``score`` (the lenient parse, the paper's number) and ``score_strict``.

The lenient list parse is deliberately the official one, quirks included: the text after the
*last* ``[`` up to the next ``]`` is split on commas and each item stripped of spaces and double
quotes, so ``'["a", "b"'`` (no closing bracket) still parses and ``'["a, b"]'`` parses as two items.
``tests/test_parallelbench.py`` checks every metric against a table of (prediction, answer,
official score) rows computed with the official ``metrics.py``, malformed predictions included.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["METRICS", "TEXT_METRICS", "parse_list", "parse_sudoku"]

Answer = Any  # a record's ``answer``: a string, or an object with ``input``/``word``/``symbols``...


def parse_list(text: str, strict: bool = False) -> list[str] | None:
    """The items of the list written in ``text`` (None: the strict form is not there)."""
    if "[" in text:
        text = text.rsplit("[", 1)[1]
    elif strict:
        return None
    if "]" in text:
        text = text.split("]", 1)[0]
    elif strict:
        return None
    if not strict:
        return [item.strip('" ') for item in text.strip("[]").split(",") if item.strip()]
    items = []
    for item in text.split(", "):
        if not (item.startswith('"') and item.endswith('"')):
            return None
        item = item[1:-1]
        if '"' in item:
            return None
        items.append(item)
    return items


def list_match(prediction: str, answer: Answer, strict: bool = False) -> float:
    """The list equals the reference list (copy, reverse, sort, insert/remove/replace at an index)."""
    got = parse_list(prediction, strict)
    return 0.0 if got is None else float(got == parse_list(answer))


def list_shuffle(prediction: str, answer: Answer, strict: bool = False) -> float:
    """A permutation of the input list other than the input order itself."""
    got, given = parse_list(prediction, strict), list(answer["input"])
    return 0.0 if got is None else float(sorted(got) == sorted(given) and got != given)


def _removed_one(longer: list[str], shorter: list[str], n_words: int) -> float:
    """``shorter`` is ``longer`` with ``n_words`` distinct words taken out (the first occurrence of
    each, by value)."""
    if len(shorter) != len(longer) - n_words:
        return 0.0
    gone = set(longer) - set(shorter)
    if len(gone) != n_words:
        return 0.0
    rest = list(longer)
    for word in gone:
        rest.remove(word)
    return float(shorter == rest)


def list_random_insert(prediction: str, answer: Answer, strict: bool = False) -> float:
    """The input list with the given word inserted anywhere (each given word removed once from the
    prediction must leave the input); without a given word, any one new word."""
    got = parse_list(prediction, strict)
    given, word, n_words = list(answer["input"]), answer["word"], answer.get("n_words", 1)
    if got is None:
        return 0.0
    if word is None:
        return _removed_one(got, given, n_words)
    got = list(got)
    for w in [word] if isinstance(word, str) else word:
        if w not in got:
            return 0.0
        got.remove(w)
    return float(got == given)


def list_random_remove(prediction: str, answer: Answer, strict: bool = False) -> float:
    """The input list with any ``n_words`` (default 1) of its words removed."""
    got = parse_list(prediction, strict)
    return 0.0 if got is None else _removed_one(list(answer["input"]), got, answer.get("n_words", 1))


def list_random_replace(prediction: str, answer: Answer, strict: bool = False) -> float:
    """The input list with the given word written over one position (its first occurrence in the
    prediction); without a given word, exactly ``n_words`` positions changed."""
    got, given = parse_list(prediction, strict), list(answer["input"])
    word, n_words = answer["word"], answer.get("n_words", 1)
    if got is None or len(got) != len(given):
        return 0.0
    if word is None:
        return float(sum(p != g for p, g in zip(got, given)) == n_words)
    if word not in got:
        return 0.0
    given[got.index(word)] = word
    return float(got == given)


def latin_square(prediction: str, answer: Answer, strict: bool = False) -> float:
    """The first ``size`` lines whose comma-separated cells are exactly the symbol set form a Latin
    square (every row and column holds each symbol), starting with ``first_row`` when given.
    ``strict`` makes no difference (as in the official metric)."""
    symbols = set(answer["symbols"])
    first_row, size = answer.get("first_row"), len(symbols)
    lines = [line.strip() for line in prediction.split("\n") if line.strip()]
    rows = [[cell.strip() for cell in line.split(",")] for line in lines]
    rows = [row for row in rows if set(row) == symbols][:size]
    if len(rows) < size:
        return 0.0
    if any(set(row) != symbols for row in rows) or any(set(col) != symbols for col in zip(*rows)):
        return 0.0
    return float(first_row is None or rows[0] == first_row)


def parse_sudoku(text: str, strict: bool = False, n: int = 4) -> list[list[int]] | None:
    """A 4x4 grid: lenient, the lines holding exactly four digits once spaces and commas are
    dropped (there must be four such lines); strict, exactly four lines of four digits."""
    text = text.strip()
    if strict:
        lines = [line.strip() for line in text.split("\n") if line.strip()]
        if len(lines) != n or any(len(line) != n or not all(c.isdecimal() for c in line) for line in lines):
            return None
        return [[int(c) for c in line] for line in lines]  # int() reads every decimal digit isdecimal() accepts
    lines = [line.strip() for line in text.replace(" ", "").replace(",", "").split("\n") if line.strip()]
    grid = [row for row in ([int(d) for d in re.findall(r"\d", line)] for line in lines) if len(row) == n]
    return grid if len(grid) == n else None


def sudoku(prediction: str, answer: Answer, strict: bool = False) -> float:
    """The grid equals the solution."""
    return float(parse_sudoku(prediction, strict) == parse_sudoku(answer, True))


Metric = Callable[[str, Answer, bool], float]

METRICS: Mapping[str, Metric] = {
    "list_match_score": list_match,
    "list_shuffle_score": list_shuffle,
    "list_random_insert_score": list_random_insert,
    "list_random_remove_score": list_random_remove,
    "list_random_replace_score": list_random_replace,
    "latin_square_score": latin_square,
    "sudoku_score": sudoku,
}
"""Official metric name -> our implementation (the Waiting Line and Puzzle groups)."""

TEXT_METRICS: Mapping[str, str] = {
    "sentence_to_words_score": "a grammar checker (LanguageTool through the language_tool_python package, Java)",
    "grammar_score": "a grammar checker (LanguageTool through the language_tool_python package, Java)",
    "startwith_score": "a grammar checker (LanguageTool through the language_tool_python package, Java)",
    "summary_score": "ROUGE from the `evaluate` package (downloaded at first use) and a grammar checker "
                     "(LanguageTool, Java)",
    "paraphrase_score": "BLEU and BERTScore from the `evaluate` package (downloaded at first use, with a "
                        "RoBERTa model) and a grammar checker (LanguageTool, Java)",
}
"""Official metrics of the text-writing tasks -> what grading them needs (not graded here)."""
