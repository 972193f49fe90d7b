"""Sort with ties: ``"tiesort:k3,b1,x3,a2="`` -> ``"b1,a2,k3,x3"`` or ``"b1,a2,x3,k3"`` (verified).

Items are a distinct letter plus a digit; the answer lists every item once, ordered by digit. Items
that share a digit may come in any order, so a problem has many correct answers, and the slots of
one tie group are coupled: each item must land in exactly one of them. Committing several slots of
a group at once from per-position marginals (each slot alone sees "any of the group") writes one
item twice — the failure parallel decoding exists to avoid, and editing exists to repair.
"""

from __future__ import annotations

import random
import string

from .base import Instance, Split, Task, int_option

__all__ = ["TieSortTask"]


class TieSortTask(Task):
    """Order ``min_len..max_len`` (default 9..12) letter-digit items by digit; ties in any order.

    Letters are distinct lowercase letters; digits are drawn from ``1..digits`` (default 4), so
    a list of 12 items has tie groups of about 3. (The default was 8..16 until the v2 testbed's
    stage d: its 4-layer model reaches ~0.8 under Q on 9..12 items and ~0.3 on 15..16.) The training reference orders each tie group at
    random (a fresh valid answer per draw); :meth:`score` accepts any valid answer: exactly the
    prompt's items (as a multiset), comma-joined, digits non-decreasing. Anything else, including
    malformed text, scores 0.

    The canonical key for the train/eval split is the item multiset, sorted.
    """

    name = "tiesort"
    description = "order letter-digit items by digit, ties in any order, e.g. tiesort:k3,b1,x3=b1,k3,x3"
    metric_name = "valid_answer"
    answer_alphabet = string.ascii_lowercase + "0123456789,"

    def __init__(self, min_len: int = 9, max_len: int = 12, digits: int = 4) -> None:
        int_option(self.name, "min_len", min_len, 2, 26)
        int_option(self.name, "max_len", max_len, 2, 26)
        int_option(self.name, "digits", digits, 1, 9)
        if not 2 <= min_len <= max_len <= 26:
            raise ValueError(f"need 2 <= min_len <= max_len <= 26, got {min_len}, {max_len}")
        if not 1 <= digits <= 9:
            raise ValueError(f"digits must be in 1..9, got {digits}")
        self.min_len, self.max_len, self.digits = min_len, max_len, digits
        self.answer_length = 3 * max_len - 1

    def _sample(self, rng: random.Random, split: Split) -> Instance:
        k = rng.randint(self.min_len, self.max_len)
        items = [f"{c}{rng.randint(1, self.digits)}" for c in rng.sample(string.ascii_lowercase, k)]
        answer = sorted(items, key=lambda it: (it[1], rng.random()))  # ties in a random order
        return Instance(prompt="tiesort:" + ",".join(items) + "=", reference=",".join(answer), meta={"items": items})

    def alternative(self, instance: Instance, rng: random.Random) -> str | None:
        """Every tie group of the reference shuffled (``None`` when no two items tie)."""
        ref = instance.reference.split(",")
        if len({it[1] for it in ref}) == len(ref):
            return None
        while True:
            alt = sorted(ref, key=lambda it: (it[1], rng.random()))
            if alt != ref:
                return ",".join(alt)

    def canonical_key(self, instance: Instance) -> str:
        return ",".join(sorted(instance.prompt.removeprefix("tiesort:").rstrip("=").split(",")))

    def score(self, instance: Instance, completion: str) -> float:
        items = instance.prompt.removeprefix("tiesort:").rstrip("=").split(",")
        got = completion.rstrip().split(",")
        if sorted(got) != sorted(items):
            return 0.0
        return float(all(a[1] <= b[1] for a, b in zip(got, got[1:])))

    def __repr__(self) -> str:
        return f"TieSortTask(min_len={self.min_len}, max_len={self.max_len}, digits={self.digits})"
