"""Evaluation-task interface: :class:`Instance`, :class:`Task` and the train/eval split rule.

Train/eval disjointness
-----------------------
Every synthetic problem has a *canonical key* (:meth:`Task.canonical_key`; by default the
prompt, but tasks may choose something coarser, e.g. ``add`` treats ``a+b`` and ``b+a`` as one
problem and ``sudoku`` keys on the solution grid). The split a problem belongs to is a pure
function of that key::

    split_of(key) == "eval"  iff  int.from_bytes(sha256(key)[:8], "big") % 8 == 0

(about 1/8 of all problems are eval problems). :meth:`Task.instances` samples candidates from
its seeded generator and *rejects and resamples* every candidate whose key falls in the other
split, so no seed, ``n`` or task parameter can ever produce a train instance equal to an eval
instance. Within one split, instances are independent draws, so duplicates are possible when
the problem space is small (e.g. single-digit additions).
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from dlm_toolkit.config import ConfigError

__all__ = ["EVAL_MODULUS", "MAX_PROMPT_CHARS", "Instance", "Split", "Task", "bool_option", "check_prompt_length",
           "int_option", "rate_option", "split_of"]

MAX_PROMPT_CHARS = 1 << 20
"""The longest prompt (or lm-eval request text) a task may hand the tokenizer, in characters: ~100
times the longest benchmark prompt here, far below what makes the Rust tokenizer abort the
process (a 200 MB question did, with no message)."""


def check_prompt_length(text: str, where: str) -> None:
    """Refuse ``text`` longer than :data:`MAX_PROMPT_CHARS` in one line naming ``where``.

    Raises:
        ValueError: (a :class:`~dlm_toolkit.config.ConfigError`) the text is too long.
    """
    if len(text) > MAX_PROMPT_CHARS:
        raise ConfigError(f"{where}: a prompt of {len(text)} characters, more than {MAX_PROMPT_CHARS}; "
                          "it is not tokenized")


def int_option(task: str, name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` when it is an ``int`` in ``[lo, hi]`` (``true`` is not 1, ``2.5`` and ``"3"`` are no
    integers; a generated task's sizes are bounded so an instance cannot take hours or the memory).

    Raises:
        ConfigError: ``task 'T': NAME: must be an integer in [LO, HI] (got V)``.
    """
    if type(value) is not int or not lo <= value <= hi:
        raise ConfigError(f"task '{task}': {name}: must be an integer in [{lo}, {hi}] (got {repr(value)[:60]})")
    return value


def rate_option(task: str, name: str, value: Any, lo: float = 0.01) -> float:
    """``value`` when it is a number (not a bool) in ``[lo, 1]`` (a generator that redraws until some
    position differs must not be asked for a rate near 0: ``1e-9`` looped for ever); else one line."""
    if type(value) not in (int, float) or not lo <= value <= 1.0:
        raise ConfigError(f"task '{task}': {name}: must be a number in [{lo:g}, 1] (got {repr(value)[:60]})")
    return float(value)


def bool_option(task: str, name: str, value: Any) -> bool:
    """``value`` when it is ``true`` or ``false`` (``"no"`` or ``0`` is not read as either)."""
    if type(value) is not bool:
        raise ConfigError(f"task '{task}': {name}: must be true or false (got {repr(value)[:60]})")
    return value


Split = Literal["train", "eval"]
EVAL_MODULUS = 8
"""A problem is in the eval split iff ``hash(canonical key) % EVAL_MODULUS == 0``."""

_SPLITS: tuple[str, ...] = ("train", "eval")


def split_of(key: str) -> Split:
    """The split (``"train"`` or ``"eval"``) that the problem with canonical ``key`` belongs to."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_MODULUS == 0 else "train"


@dataclass(frozen=True)
class Instance:
    """One problem.

    Attributes:
        prompt: the text the model is conditioned on (ends right before the answer).
        reference: the reference answer (what the model should generate before EOS).
        meta: task-specific extras (e.g. the sudoku givens, HumanEval tests); excluded from
            hashing so instances can be put in sets.
    """

    prompt: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False)


class Task(ABC):
    """A task = a deterministic instance generator + a scorer.

    Class attributes every task defines:
        name: registry name (``get_task(name)``).
        description: one-line human description.
        metric_name: what :meth:`score` measures, e.g. ``"exact_match"``.
        answer_alphabet: characters a valid answer uses (for the random-guess baseline).

    Instance attribute:
        answer_length: the most answer characters the model must generate, EOS excluded
            (use it as ``gen_length``; with the character tokenizer, characters == tokens).
    """

    name: ClassVar[str]
    description: ClassVar[str]
    metric_name: ClassVar[str] = "exact_match"
    answer_alphabet: ClassVar[str] = ""
    eval_size: ClassVar[int | None] = None  # distinct eval instances; None: generated without limit
    answer_length: int
    # Prompting (set by ``get_task(name, chat=..., system=...)``; see :mod:`dlm_toolkit.models.chat`):
    chat: str = "auto"  # auto | true | false: format prompts with the checkpoint's chat template
    system: str | None = None  # system turn prepended in chat mode
    stop: tuple[str, ...] = ()  # text that ends a completion (and the decode of further blocks)
    _parallel_scoring: ClassVar[bool] = False  # score_batch uses threads (subprocess scoring)

    # ----------------------------------------------------------------- generation
    def instances(self, n: int, seed: int, split: Split) -> list[Instance]:
        """``n`` instances of ``split``, deterministic given ``(n, seed, split)`` and the task's
        constructor arguments; the first ``k`` instances do not depend on ``n``.

        Candidates whose canonical key belongs to the other split are rejected and resampled
        (see the module docstring), so train and eval never overlap.

        Raises:
            ValueError: if ``n <= 0`` or ``split`` is not ``"train"``/``"eval"``.
        """
        _check_args(n, split)
        rng = random.Random(f"{self.name}|{seed}|{split}")
        out: list[Instance] = []
        max_attempts = 1000 + 200 * n
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > max_attempts:
                raise RuntimeError(
                    f"{self.name}: could not find {n} {split} instances in {max_attempts} draws"
                )
            inst = self._sample(rng, split)
            if inst is not None and self.split_of(inst) == split:
                out.append(inst)
        return out

    @abstractmethod
    def _sample(self, rng: random.Random, split: Split) -> Instance | None:
        """Draw one candidate from ``rng`` (``None`` = rejected early, e.g. wrong split)."""

    def user_message(self, instance: Instance) -> str:
        """What the user turn says when the prompt goes through a chat template: by default the
        plain prompt; benchmarks whose raw prompt is completion-style give an instruction."""
        return instance.meta.get("chat_prompt", instance.prompt)

    def chat_messages(self, instance: Instance) -> list[dict[str, str]] | None:
        """The whole conversation for the chat template when the task has several turns (in-context
        examples as earlier user/assistant turns); None (the default): one user turn,
        :meth:`user_message`."""
        return None

    def canonical_key(self, instance: Instance) -> str:
        """The problem's identity for the train/eval split; by default its prompt."""
        return instance.prompt

    def split_of(self, instance: Instance) -> Split:
        """The split ``instance`` belongs to (see the module docstring)."""
        return split_of(self.canonical_key(instance))

    # ----------------------------------------------------------------- scoring
    @abstractmethod
    def score(self, instance: Instance, completion: str) -> float:
        """Score in ``[0, 1]`` of ``completion`` (decoded model output, EOS and everything after
        it already removed) on ``instance``."""

    def score_batch(
        self, instances: Sequence[Instance], completions: Sequence[str], workers: int = 2
    ) -> list[float]:
        """:meth:`score` for each pair, in order. Tasks whose scoring waits on subprocesses
        (HumanEval) score ``workers`` pairs at a time in threads; the others score sequentially.

        Raises:
            ValueError: if the two sequences differ in length or ``workers < 1``.
        """
        if len(instances) != len(completions):
            raise ValueError(
                f"got {len(instances)} instances but {len(completions)} completions"
            )
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if workers == 1 or len(instances) <= 1 or not self._parallel_scoring:
            return [self.score(i, c) for i, c in zip(instances, completions)]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self.score, instances, completions))

    def alternative(self, instance: Instance, rng: random.Random) -> str | None:
        """Another correct answer of the same length as the reference, drawn with ``rng``, or
        ``None`` when the task has only one (the default).

        Training uses it to write plausible drafting errors: a position where the two answers
        differ holds the other answer's token, as when positions of one choice are committed
        together from per-position marginals (see ``alternative_rate`` in
        :class:`~dlm_toolkit.training.loop.TrainConfig`).
        """
        return None

    # ----------------------------------------------------------------- baselines
    def random_guess(self, instance: Instance, rng: random.Random) -> str:
        """A guess that knows the reference's length and the answer alphabet, nothing else."""
        return "".join(rng.choice(self.answer_alphabet) for _ in instance.reference)

    def chance_score(self, n: int = 500, seed: int = 0) -> float:
        """Mean score of :meth:`random_guess` on ``n`` eval instances: the chance level.

        For every task here chance is ~0 (add: ~0.005, almost all from one-digit sums; sort,
        sudoku, HumanEval: 0.0), so any measurable accuracy is real signal.
        """
        rng = random.Random(f"chance|{self.name}|{seed}")
        insts = self.instances(n, seed, "eval")
        return sum(self.score(i, self.random_guess(i, rng)) for i in insts) / len(insts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(answer_length={self.answer_length})"


def _check_args(n: int, split: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n must be a positive integer, got n={n!r}")
    if split not in _SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', got split={split!r}")
