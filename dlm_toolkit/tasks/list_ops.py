"""List tasks at token level with a known answer distribution, the testbed of the oracle models.

Each item is one character of :data:`~dlm_toolkit.models.oracle.ITEM_CHARS` (with the character
tokenizer: one token), the prompt is ``kind:items[,extra]=`` and the answer is exactly the item
tokens, no separators (EOS follows it). Items of an instance are distinct, drawn from the first
``alphabet`` characters.

=================  ==================================================  ====================
task               valid answers (each equally likely)                  answers
=================  ==================================================  ====================
``list_copy``      the items                                            1
``list_reverse``   the items reversed                                   1
``list_sort``      the items in alphabet order                          1
``list_shuffle``   any order of the items (``exclude_original``: any    n! (n! - 1)
                   but the given one, as ParallelBench's shuffle)
``list_replace``   one position replaced by the new item                n
``list_insert``    the new item inserted at one position                n + 1
``latin_square``   a latin square of ``order`` over the given symbols   576 (order 4)
=================  ==================================================  ====================

Scores are 1.0 for a valid answer, else 0.0 (any valid answer counts: the metric is
``valid_answer``). ``--checkpoint oracle:TASK`` (:mod:`dlm_toolkit.models.oracle`) is the exact
model of each.
"""

from __future__ import annotations

import random
from typing import ClassVar

from dlm_toolkit.models.oracle import (ITEM_CHARS, ListInstance, answer_length, is_valid, latin_squares, parse_prompt,
                                       prompt_text)

from .base import Instance, Split, Task

__all__ = ["LIST_TASKS", "LatinSquareTask", "ListTask"]

MAX_ITEMS = 16


class ListTask(Task):
    """A list task (module docstring): ``n_items`` distinct items (2..16) from an alphabet of
    ``alphabet`` characters (``n_items`` .. 62, plus one for replace/insert: the new item is not
    in the list)."""

    metric_name = "valid_answer"
    answer_alphabet = ITEM_CHARS
    kind: ClassVar[str]
    extra_item: ClassVar[bool] = False

    def __init__(self, n_items: int = 6, alphabet: int = 26) -> None:
        for name, value in (("n_items", n_items), ("alphabet", alphabet)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{self.name}: {name} must be an integer, got {value!r}")
        if not 2 <= n_items <= MAX_ITEMS:
            raise ValueError(f"{self.name}: n_items must be in 2..{MAX_ITEMS}, got {n_items}")
        need = n_items + self.extra_item
        if not need <= alphabet <= len(ITEM_CHARS):
            raise ValueError(f"{self.name}: alphabet must be in {need}..{len(ITEM_CHARS)} (n_items"
                             f"{' + 1' if self.extra_item else ''} .. 62), got {alphabet}")
        self.n_items, self.alphabet = n_items, alphabet
        self.answer_length = answer_length(self.kind, n_items)

    def _instance(self, rng: random.Random) -> ListInstance:
        chars = rng.sample(ITEM_CHARS[:self.alphabet], self.n_items + self.extra_item)
        items = "".join(chars[:self.n_items])
        return ListInstance(self.kind, items, "".join(chars[self.n_items:]))

    def _sample(self, rng: random.Random, split: Split) -> Instance:
        inst = self._instance(rng)
        return Instance(prompt=prompt_text(inst), reference=self._reference(inst, rng), meta={"items": inst.items})

    def _reference(self, inst: ListInstance, rng: random.Random) -> str:
        from dlm_toolkit.models.oracle import valid_answers

        answers = valid_answers(inst)
        assert answers is not None
        return rng.choice(answers)

    def alternative(self, instance: Instance, rng: random.Random) -> str | None:
        """Another valid answer (None when the answer is unique)."""
        inst = parse_prompt(instance.prompt)
        assert inst is not None
        for _ in range(64):
            alt = self._reference(inst, rng)
            if alt != instance.reference:
                return alt
        return None

    def score(self, instance: Instance, completion: str) -> float:
        inst = parse_prompt(instance.prompt)
        return float(inst is not None and is_valid(inst, completion.rstrip()))

    def random_guess(self, instance: Instance, rng: random.Random) -> str:
        return "".join(rng.choice(ITEM_CHARS[:self.alphabet]) for _ in instance.reference)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_items={self.n_items}, alphabet={self.alphabet})"


def _list_task(kind: str, doc: str, extra: bool = False) -> type[ListTask]:
    cls = type(kind.title().replace("_", "") + "Task", (ListTask,),
               {"name": kind, "kind": kind, "extra_item": extra, "description": doc, "__doc__": doc})
    return cls


ListCopyTask = _list_task("list_copy", "copy the items, e.g. list_copy:qbx=qbx")
ListReverseTask = _list_task("list_reverse", "reverse the items, e.g. list_reverse:qbx=xbq")
ListSortTask = _list_task("list_sort", "sort the items by the alphabet, e.g. list_sort:qbx=bqx")
ListReplaceTask = _list_task("list_replace", "replace one item by the new one, e.g. list_replace:qbx,k=qkx", True)
ListInsertTask = _list_task("list_insert", "insert the new item anywhere, e.g. list_insert:qbx,k=qbkx", True)


class ListShuffleTask(ListTask):
    """Any order of the items, uniformly; ``exclude_original``: any but the given order
    (ParallelBench's shuffle; the prompt header is then ``list_shuffle_new``)."""

    name = kind = "list_shuffle"
    description = "any order of the items, e.g. list_shuffle:qbx=xqb"

    def __init__(self, n_items: int = 6, alphabet: int = 26, exclude_original: bool = False) -> None:
        super().__init__(n_items, alphabet)
        if not isinstance(exclude_original, bool):
            raise ValueError(f"list_shuffle: exclude_original must be true or false, got {exclude_original!r}")
        self.exclude_original = exclude_original

    def _instance(self, rng: random.Random) -> ListInstance:
        inst = super()._instance(rng)
        return ListInstance(inst.kind, inst.items, "", self.exclude_original)

    def _reference(self, inst: ListInstance, rng: random.Random) -> str:
        while True:
            order = "".join(rng.sample(inst.items, len(inst.items)))
            if is_valid(inst, order):
                return order


class LatinSquareTask(ListTask):
    """A latin square of ``order`` (2..4, default 4: 576 squares) over ``order`` distinct symbols
    given in the prompt (``latin_square:abcd=``), row-major, uniform over the squares."""

    name = kind = "latin_square"
    description = "a 4x4 latin square over the given symbols, row-major, e.g. latin_square:ab=abba"

    def __init__(self, order: int = 4, alphabet: int = 26) -> None:
        if isinstance(order, bool) or not isinstance(order, int) or not 2 <= order <= 4:
            raise ValueError(f"latin_square: order must be in 2..4, got {order!r}")
        super().__init__(order, alphabet)
        self.order = order

    def _reference(self, inst: ListInstance, rng: random.Random) -> str:
        return "".join(inst.items[s] for s in rng.choice(latin_squares(self.order)))  # one square, not all 576

    def __repr__(self) -> str:
        return f"LatinSquareTask(order={self.order}, alphabet={self.alphabet})"


LIST_TASKS: tuple[type[ListTask], ...] = (ListCopyTask, ListReverseTask, ListSortTask, ListShuffleTask,
                                          ListReplaceTask, ListInsertTask, LatinSquareTask)
"""The oracle tasks, in the order of :data:`dlm_toolkit.models.oracle.KINDS`."""
