"""Copy either: ``"either:abQdR|ab3d7="`` -> ``"abQdR"`` or ``"ab3d7"`` (verified).

The answer is one of two given strings, whole. Where the two agree every position is certain;
where they differ each position alone is a coin flip, yet all of them must follow the same
choice. Committing several differing positions at once from per-position marginals mixes the
two strings — an answer that is neither.

By default (``marked``) the first string differs by uppercase letters and the second by digits,
so one committed differing character tells which string is being written: the choice is easy to
*condition* on, hard to make in parallel. A 4-layer testbed never learned the unmarked variant's
comparison of each written character against both strings (Q-mode accuracy 0.004).
"""

from __future__ import annotations

import random
import string

from .base import Instance, Split, Task, bool_option, int_option, rate_option

MAX_LEN = 1000
"""The longest string an option may ask for."""

__all__ = ["EitherTask", "marked_pair"]


def marked_pair(rng: random.Random, differs: list[bool]) -> tuple[str, str]:
    """Two strings that agree (lowercase letters) where ``differs`` is False and differ elsewhere:
    an uppercase letter in the first, a digit in the second (all of the first drawn, then the second)."""
    a = [rng.choice(string.ascii_uppercase if d else string.ascii_lowercase) for d in differs]
    b = [rng.choice(string.digits) if d else x for d, x in zip(differs, a)]
    return "".join(a), "".join(b)


class EitherTask(Task):
    """Copy one of two strings of ``min_len..max_len`` (default 24..32) characters.

    Each position differs with probability ``differ`` (default 0.35; at least two positions
    differ). Marked (default): shared positions are lowercase letters, differing ones an uppercase
    letter in the first string and a digit in the second. Unmarked: the first string is lowercase
    and the second replaces each differing position by another lowercase letter. The training reference is
    either string at random; :meth:`score` accepts exactly the two strings (trailing whitespace
    stripped); a mixture, a prefix or malformed text scores 0.

    The canonical key for the train/eval split is the unordered pair.
    """

    name = "either"
    description = "copy either of two strings whole, e.g. either:abcd|abxd=abxd"
    metric_name = "valid_answer"
    answer_alphabet = string.ascii_letters + string.digits

    def __init__(self, min_len: int = 24, max_len: int = 32, differ: float = 0.35, marked: bool = True) -> None:
        int_option(self.name, "min_len", min_len, 2, MAX_LEN)
        int_option(self.name, "max_len", max_len, 2, MAX_LEN)
        if not min_len <= max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
        self.min_len, self.max_len = min_len, max_len
        self.differ, self.marked = rate_option(self.name, "differ", differ), bool_option(self.name, "marked", marked)
        self.answer_length = max_len

    def _sample(self, rng: random.Random, split: Split) -> Instance:
        n = rng.randint(self.min_len, self.max_len)
        while True:
            differs = [rng.random() < self.differ for _ in range(n)]
            if sum(differs) >= 2:
                break
        if self.marked:
            options = list(marked_pair(rng, differs))
        else:
            a = [rng.choice(string.ascii_lowercase) for _ in differs]
            b = [rng.choice([c for c in string.ascii_lowercase if c != x]) if d else x for d, x in zip(differs, a)]
            options = ["".join(a), "".join(b)]
        return Instance(prompt=f"either:{options[0]}|{options[1]}=", reference=rng.choice(options),
                        meta={"options": options})

    def alternative(self, instance: Instance, rng: random.Random) -> str | None:
        """The other string."""
        a, b = self._options(instance)
        return b if instance.reference == a else a

    def _options(self, instance: Instance) -> list[str]:
        return instance.prompt.removeprefix("either:").rstrip("=").split("|")

    def canonical_key(self, instance: Instance) -> str:
        return "|".join(sorted(self._options(instance)))

    def score(self, instance: Instance, completion: str) -> float:
        return float(completion.rstrip() in self._options(instance))

    def __repr__(self) -> str:
        return f"EitherTask(min_len={self.min_len}, max_len={self.max_len}, differ={self.differ}, marked={self.marked})"
