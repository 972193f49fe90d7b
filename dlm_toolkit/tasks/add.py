"""Integer addition: ``"12345+678="`` -> ``"13023"`` (exact match)."""

from __future__ import annotations

import random

from .base import Instance, Split, Task, int_option

MAX_DIGITS = 1000
"""The longest operand an option may ask for (an instance of 10^18 digits never finished)."""

__all__ = ["AddTask"]


class AddTask(Task):
    """Add two non-negative integers of 1..``max_digits`` digits.

    Each operand first draws its digit count uniformly from ``1..max_digits`` and then its value
    uniformly among the numbers with exactly that many digits (``0..9`` for one digit), so short
    operands are as common as long ones. The answer is the decimal sum without leading zeros;
    scoring is exact match after stripping trailing whitespace.

    ``a+b`` and ``b+a`` are the same problem for the train/eval split (canonical key
    ``"min+max"``), so an eval sum is never seen in training with its operands swapped.
    """

    name = "add"
    description = "add two integers of 1-5 digits, e.g. 12345+678=13023"
    metric_name = "exact_match"
    answer_alphabet = "0123456789"

    def __init__(self, max_digits: int = 5) -> None:
        int_option(self.name, "max_digits", max_digits, 1, MAX_DIGITS)
        self.max_digits = max_digits
        self.answer_length = max_digits + 1  # 99999+99999=199998

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def _sample(self, rng: random.Random, split: Split) -> Instance:
        a, b = self._operand(rng), self._operand(rng)
        return Instance(prompt=f"{a}+{b}=", reference=str(a + b), meta={"a": a, "b": b})

    def canonical_key(self, instance: Instance) -> str:
        a, b = (int(x) for x in instance.prompt.rstrip("=").split("+"))
        return f"{min(a, b)}+{max(a, b)}"

    def score(self, instance: Instance, completion: str) -> float:
        return float(completion.rstrip() == instance.reference)

    def __repr__(self) -> str:
        return f"AddTask(max_digits={self.max_digits})"
