"""Pick per chunk: ``"pick:abQ.dRe|ab3.d7e="`` -> ``"abQ.d7e"``, ``"ab3.dRe"``, ... (verified).

Two strings split into the same chunks (``.``-separated); the answer takes every chunk whole from
either string, independently of the other chunks, so a problem with K chunks has 2^K correct
answers. As in marked ``either``, shared positions are lowercase letters and differing ones an
uppercase letter in the first string and a digit in the second. Inside a chunk the differing
positions are coupled (a coin flip each alone, one choice together); chunks are not. So a careful
decoder needs about one guess -- one forward -- per chunk, while committing many positions at once
mixes the strings inside chunks: the task where parallel drafting is worth the most and costs the
most.
"""

from __future__ import annotations

import random
import string

from .base import Instance, Split, Task, int_option, rate_option
from .either import marked_pair

MAX_CHUNKS = 100
"""The most chunks, and the longest chunk, an option may ask for."""

__all__ = ["PickTask"]


class PickTask(Task):
    """``min_chunks..max_chunks`` (default 5..7) chunks of ``min_chunk..max_chunk`` (default 3..5)
    characters; each position differs with probability ``differ`` (default 0.4; at least one per
    chunk). The training reference picks each chunk's string at random; :meth:`score` accepts
    exactly the answers made of whole chunks in order (trailing whitespace stripped).

    The canonical key for the train/eval split is the unordered pair of strings.
    """

    name = "pick"
    description = "take each chunk whole from either string, e.g. pick:abQ.dRe|ab3.d7e=abQ.d7e"
    metric_name = "valid_answer"
    answer_alphabet = string.ascii_letters + string.digits + "."

    def __init__(self, min_chunks: int = 5, max_chunks: int = 7, min_chunk: int = 3, max_chunk: int = 5,
                 differ: float = 0.4) -> None:
        for option, value in (("min_chunks", min_chunks), ("max_chunks", max_chunks), ("min_chunk", min_chunk),
                              ("max_chunk", max_chunk)):
            int_option(self.name, option, value, 1, MAX_CHUNKS)
        if not 1 <= min_chunks <= max_chunks:
            raise ValueError(f"need 1 <= min_chunks <= max_chunks, got {min_chunks}, {max_chunks}")
        if not 1 <= min_chunk <= max_chunk:
            raise ValueError(f"need 1 <= min_chunk <= max_chunk, got {min_chunk}, {max_chunk}")
        self.min_chunks, self.max_chunks, self.min_chunk, self.max_chunk = min_chunks, max_chunks, min_chunk, max_chunk
        self.differ = rate_option(self.name, "differ", differ)
        self.answer_length = max_chunks * (max_chunk + 1) - 1

    def _sample(self, rng: random.Random, split: Split) -> Instance:
        a_chunks, b_chunks, picked = [], [], []
        for _ in range(rng.randint(self.min_chunks, self.max_chunks)):
            size = rng.randint(self.min_chunk, self.max_chunk)
            while True:
                differs = [rng.random() < self.differ for _ in range(size)]
                if any(differs):
                    break
            a, b = marked_pair(rng, differs)
            a_chunks.append(a)
            b_chunks.append(b)
            picked.append(rng.choice((a, b)))
        a, b = ".".join(a_chunks), ".".join(b_chunks)
        return Instance(prompt=f"pick:{a}|{b}=", reference=".".join(picked), meta={"options": [a, b]})

    def _options(self, instance: Instance) -> list[str]:
        return instance.prompt.removeprefix("pick:").rstrip("=").split("|")

    def alternative(self, instance: Instance, rng: random.Random) -> str | None:
        """Each chunk from a fair coin, at least one chunk taken from the other string."""
        a, b = (s.split(".") for s in self._options(instance))
        ref = instance.reference.split(".")
        other = [y if r == x else x for r, x, y in zip(ref, a, b)]
        flip = [rng.random() < 0.5 for _ in ref]
        flip[rng.randrange(len(ref))] = True
        return ".".join(o if f else r for r, o, f in zip(ref, other, flip))

    def canonical_key(self, instance: Instance) -> str:
        return "|".join(sorted(self._options(instance)))

    def score(self, instance: Instance, completion: str) -> float:
        a, b = (s.split(".") for s in self._options(instance))
        got = completion.rstrip().split(".")
        return float(len(got) == len(a) and all(g in (x, y) for g, x, y in zip(got, a, b)))

    def __repr__(self) -> str:
        return (f"PickTask(min_chunks={self.min_chunks}, max_chunks={self.max_chunks}, min_chunk={self.min_chunk}, "
                f"max_chunk={self.max_chunk}, differ={self.differ})")
