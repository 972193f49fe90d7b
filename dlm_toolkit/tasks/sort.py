"""Sorting: ``"sort:45,12,99,...="`` -> ``"12,45,99,..."`` (exact match)."""

from __future__ import annotations

import random

from .base import Instance, Split, Task, int_option

MAX_LEN = 1000
"""The longest list an option may ask for (a list of 10^8 numbers never finished)."""

__all__ = ["SortTask"]


class SortTask(Task):
    """Sort a list of ``min_len..max_len`` (default 8..16) two-digit numbers ascending.

    Numbers are drawn uniformly and independently (duplicates allowed) from ``10..99``, so every
    number is exactly two characters, no zero padding. The list length is uniform in
    ``min_len..max_len``. Answer: the numbers comma-joined in ascending order (duplicates kept);
    exact match after stripping trailing whitespace.

    The canonical key for the train/eval split is the sorted multiset (= the answer), so an eval
    list is never seen in training in any other order either.
    """

    name = "sort"
    description = "sort 8-16 two-digit numbers, e.g. sort:45,12,99=12,45,99"
    metric_name = "exact_match"
    answer_alphabet = "0123456789,"

    def __init__(self, min_len: int = 8, max_len: int = 16) -> None:
        int_option(self.name, "min_len", min_len, 1, MAX_LEN)
        int_option(self.name, "max_len", max_len, 1, MAX_LEN)
        if not min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.min_len, self.max_len = min_len, max_len
        self.answer_length = 3 * max_len - 1  # "dd," * len minus the last comma

    def _sample(self, rng: random.Random, split: Split) -> Instance:
        k = rng.randint(self.min_len, self.max_len)
        nums = [rng.randint(10, 99) for _ in range(k)]
        return Instance(
            prompt="sort:" + ",".join(map(str, nums)) + "=",
            reference=",".join(map(str, sorted(nums))),
            meta={"numbers": nums},
        )

    def canonical_key(self, instance: Instance) -> str:
        body = instance.prompt.removeprefix("sort:").rstrip("=")
        return ",".join(sorted(body.split(",")))

    def score(self, instance: Instance, completion: str) -> float:
        return float(completion.rstrip() == instance.reference)

    def __repr__(self) -> str:
        return f"SortTask(min_len={self.min_len}, max_len={self.max_len})"
