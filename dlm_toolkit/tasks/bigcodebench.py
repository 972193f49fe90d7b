"""BigCodeBench (``bigcodebench``): complete or implement a library-using Python function, graded by the
task's own ``unittest`` module in the sandbox, as the official harness grades.

Data: the official release JSONL (``BigCodeBench.jsonl`` of ``bigcode-project/bigcodebench-annotation``,
fields ``task_id``, ``complete_prompt``, ``instruct_prompt``, ``canonical_solution``, ``code_prompt``,
``test``, ``entry_point``, ``doc_struct``, ``libs``). Splits (``split``): ``complete`` (the docstring
prompt) and ``instruct`` (the natural-language instruction). Subsets (``subset``): ``full`` or ``hard``;
``hard`` keeps the task ids listed in ``hard_ids`` (a text file with one id a line, or a JSONL file
with a ``task_id`` per record such as the official ``BigCodeBench-Hard.jsonl``), or, without
``hard_ids``, the records whose boolean field ``hard`` is true.

Prompts, as the official ``bigcodebench.generate`` builds them:

* ``complete``, raw (a base model, direct completion): ``complete_prompt``; the completion continues
  the function body; stop strings = the official ones plus its extra ones for direct completion
  (``\\ndef ``, ``\\nclass ``, ``\\nimport ``, ``\\nfrom ``, ``\\nassert ``).
* chat (``chat: true``) or ``instruct``: the official instruction prefix, then the prompt (inside a
  fence for ``complete``), answered with a code block; the raw ``instruct`` prompt ends with the
  official response prefix and an opened ```` ```python ```` fence.

Program graded (:meth:`BigCodeBenchTask.program`): the answer's code when it defines ``entry_point``
(a chat answer); a fenced body after ``code_prompt``; otherwise the completion continues the raw
``complete`` prompt: ``complete_prompt + completion`` (the official ``solution = prompt + completion``).

Grading (:func:`~dlm_toolkit.tasks.unittest_box.run_unittest`): the program and then ``test`` run in
one module in the bubblewrap sandbox, its ``TestCases`` under our harness; a task passes when the
module loads and every test it defines runs to its end without failure or error, within the per-task
wall-clock limit (official default 240 s). Where it departs from the official harness (which counts
failures and errors only), a completion fails that the official one passes: zero tests run, a test
skipped by a ``SkipTest`` the test did not raise, an expected failure the module does not declare, a
test ended by ``unittest``'s internal ``_ShouldStop``, or any change to the test machinery
(``unittest``, ``builtins``, what the tests name): see ``unittest_harness.py``. The sandbox sees the libraries of the Python environment given by ``python`` (default: the
one the toolkit runs in; ``pip install 'dlm-toolkit[bigcodebench]'`` adds a pinned set).

Missing libraries: before anything is decoded, the modules each task imports (its prompt, canonical
solution and tests, parsed with :mod:`ast`) are looked up in the sandbox's interpreter. A task with
any missing is ``env_missing``: it is left out of the instances (never scored as wrong), and
:attr:`BigCodeBenchTask.env_missing` / :meth:`BigCodeBenchTask.env_report` give the count and the
modules; ``on_env_missing: error`` refuses instead.
"""

from __future__ import annotations

from typing import Optional

import ast
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from dlm_toolkit.config import ConfigError

from .base import Instance
from .code import code_limits, extract_code
from .data import BenchmarkTask, DataError, DataSource, RowSchema, read_data_text, read_jsonl
from .sandbox import check_isolation
from .unittest_box import LibraryEnv, UnittestResult, library_env, probe_modules, run_unittest, top_level_imports

__all__ = ["BigCodeBenchTask", "INSTRUCTION_PREFIX", "RESPONSE_PREFIX"]

FIELDS = ("task_id", "complete_prompt", "instruct_prompt", "canonical_solution", "code_prompt", "test", "entry_point")


class BigCodeBenchRow(RowSchema):
    """The fields of an official release record the task reads (strict: a number where a string
    belongs is refused naming the field); ``hard`` marks a Hard-subset task where no id list is given."""

    task_id: str
    complete_prompt: str
    instruct_prompt: str
    canonical_solution: str
    code_prompt: str
    test: str
    entry_point: str
    hard: Optional[bool] = None


class TaskIdRow(RowSchema):
    """A record of the official ``BigCodeBench-Hard.jsonl``: only its id is read."""

    task_id: str
INSTRUCTION_PREFIX = ("Please provide a self-contained Python script that solves the following problem in a "
                      "markdown code block:")
RESPONSE_PREFIX = ("Below is a Python script with a self-contained function that solves the problem and passes "
                   "corresponding tests:")
OFFICIAL_STOP = ("<|endoftext|>", "<|endofmask|>", "</s>", "\nif __name__", "\ndef main(", "\nprint(")
COMPLETION_STOP = ("\ndef ", "\nclass ", "\nimport ", "\nfrom ", "\nassert ")
SPLITS = ("complete", "instruct")
SUBSETS = ("full", "hard")


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and value.isidentifier()


def read_hard_ids(path: Path) -> set[str]:
    """Task ids of the hard subset from ``path``: a JSONL file with ``task_id`` in each record, or
    plain text with one id a line (blank lines and ``#`` comments skipped).

    Raises:
        DataError: the file is missing or lists no id.
    """
    if not path.is_file():
        raise DataError(f"hard_ids: no file at {path} (a list of task ids, one a line, or the official "
                        "BigCodeBench-Hard.jsonl)")
    text = read_data_text(path)
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    if first.lstrip().startswith("{"):
        ids = {row.data["task_id"] for row in read_jsonl(path, TaskIdRow)}
    else:
        ids = {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")}
    if not ids:
        raise DataError(f"hard_ids: {path} lists no task id")
    return ids


EXTRA_MODULES = frozenset({"numpy", "pandas", "scipy", "matplotlib", "seaborn", "sklearn", "statsmodels", "requests",
                           "bs4", "dateutil", "pytz", "nltk", "faker", "PIL", "openpyxl"})
"""The top-level modules ``pip install 'dlm-toolkit[bigcodebench]'`` provides (pyproject.toml's extra;
a test keeps the two the same): the env_missing line suggests the extra only for these."""


class BigCodeBenchTask(BenchmarkTask):
    """BigCodeBench pass@1 (greedy), graded by each task's unit tests in the sandbox.

    Args:
        data: the release JSONL (file, or folder holding ``BigCodeBench.jsonl``).
        split: ``complete`` or ``instruct``.
        subset: ``full`` or ``hard``.
        hard_ids: for ``subset: hard``, the file listing its task ids (see the module docstring).
        answer_length: generation budget in tokens (official ``max_new_tokens``: 1280).
        timeout_s: wall-clock limit per task (official: 240 s).
        memory_mb: address-space limit (official: 30 GiB; the default, lowered to half of this machine's memory).
        python: the interpreter of the environment whose libraries the sandbox sees (default: this one).
        on_env_missing: ``skip`` (leave such tasks out and report them) or ``error`` (refuse).
        unsafe_exec: run without bubblewrap where it is missing (process limits only).
    """

    name = "bigcodebench"
    description = "BigCodeBench (complete/instruct, full/hard): a task's unittest module in the sandbox"
    metric_name = "pass@1"
    _parallel_scoring = True
    source = DataSource(
        folder="bigcodebench", filename="BigCodeBench.jsonl",
        fetch="mkdir -p data/bigcodebench && curl -fL https://github.com/bigcode-project/bigcodebench-annotation/"
              "releases/download/v0.1.4/BigCodeBench.jsonl.gz | gunzip > data/bigcodebench/BigCodeBench.jsonl",
        licence="Apache-2.0 (bigcode-project/bigcodebench)",
    )

    def __init__(self, data: str | Path | None = None, split: str = "complete", subset: str = "full",
                 hard_ids: str | Path | None = None, answer_length: int = 1280, timeout_s: float = 240.0,
                 memory_mb: int | None = None, python: str | None = None, on_env_missing: str = "skip",
                 unsafe_exec: bool = False) -> None:
        if split not in SPLITS:
            raise ConfigError(f"split: must be one of {', '.join(SPLITS)} (got {split!r})")
        if subset not in SUBSETS:
            raise ConfigError(f"subset: must be one of {', '.join(SUBSETS)} (got {subset!r})")
        if on_env_missing not in ("skip", "error"):
            raise ConfigError(f"on_env_missing: must be 'skip' or 'error' (got {on_env_missing!r})")
        limits = code_limits(self.name, timeout_s=timeout_s, memory_mb=memory_mb, default_memory_mb=30 * 1024)
        if python is not None and not Path(python).is_file():
            raise ConfigError(f"python: no interpreter at {python}")
        self.split, self.subset = split, subset
        self.hard = read_hard_ids(Path(hard_ids).expanduser()) if hard_ids not in (None, "") else None
        self.timeout_s, self.memory_mb, self.unsafe_exec = limits.timeout_s, limits.memory_mb, bool(unsafe_exec)
        self.isolation = check_isolation(unsafe_exec)
        self.env: LibraryEnv = library_env(python or sys.executable)
        self.env_missing: dict[str, list[str]] = {}
        # the raw instruct prompt ends inside an opened fence: its closing fence ends the code
        self.stop = OFFICIAL_STOP + (COMPLETION_STOP if split == "complete" else ("\n```",))
        super().__init__(data, answer_length)
        if self.env_missing and on_env_missing == "error":
            raise ConfigError(f"task 'bigcodebench': {self.env_report()}")
        if self.env_missing:
            print(f"bigcodebench: {self.env_report()}", file=sys.stderr)
        if self.isolation == "process":
            print("bigcodebench: without bubblewrap its code runs with process limits only and no reliability guard "
                  "(its tasks delete files, set environment variables and start processes): a throw-away machine only",
                  file=sys.stderr)

    # ----------------------------------------------------------------- data
    def _load(self, path: Path) -> list[Instance]:
        keep = []
        for row in read_jsonl(path, BigCodeBenchRow):
            r = row.data
            if not _is_name(r["entry_point"]):
                raise DataError(f"{row.where}: 'entry_point' {r['entry_point']!r} is not a Python name")
            if self.subset == "hard" and not (r["task_id"] in self.hard if self.hard is not None else r.get("hard")):
                continue
            keep.append(r)
        if self.subset == "hard" and self.hard is None and not keep:
            raise DataError(f"task 'bigcodebench': subset 'hard' needs hard_ids (a file of task ids) or records "
                            f"with \"hard\": true; {path} has none")
        needs = {r["task_id"]: sorted(top_level_imports(r["complete_prompt"], r["canonical_solution"], r["test"]))
                 for r in keep}
        found = probe_modules(sorted({m for mods in needs.values() for m in mods}), env=self.env,
                              unsafe_exec=self.unsafe_exec, isolation=self.isolation) if keep else {}
        out = []
        for r in keep:
            missing = [m for m in needs[r["task_id"]] if not found.get(m)]
            if missing:
                self.env_missing[r["task_id"]] = missing
                continue
            out.append(self._instance(r))
        if keep and not out:
            raise DataError(f"task 'bigcodebench': every task of {path} is env_missing: {self.env_report()}")
        return out

    def env_report(self) -> str:
        """One line: how many tasks are ``env_missing`` and the modules they miss (most needed first)."""
        if not self.env_missing:
            return "env_missing: 0 tasks"
        counts = Counter(m for mods in self.env_missing.values() for m in mods)
        modules = ", ".join(f"{m} ({c})" for m, c in counts.most_common())
        why = f"; {self.env.problem}" if self.env.problem else ""
        extra = [m for m in counts if m in EXTRA_MODULES]
        others = [m for m in counts if m not in EXTRA_MODULES]
        fixes = [f"pip install 'dlm-toolkit[bigcodebench]' provides {', '.join(extra)}"] if extra else []
        fixes += [f"the sandbox interpreter lacks {', '.join(others)} (no extra of dlm-toolkit provides "
                  f"{'it' if len(others) == 1 else 'them'}): install {'it' if len(others) == 1 else 'them'} into "
                  "that environment"] if others else []
        return (f"env_missing: {len(self.env_missing)} task(s) left out, their libraries are not importable in "
                f"the sandbox ({self.env.python}): {modules}{why}; {'; '.join(fixes)}; or pass python=<interpreter>")

    def _instance(self, r: dict[str, Any]) -> Instance:
        if self.split == "complete":
            body = f"{INSTRUCTION_PREFIX}\n```\n{r['complete_prompt'].strip()}\n```\n"
            prompt = r["complete_prompt"]
        else:
            body = f"{INSTRUCTION_PREFIX}\n{r['instruct_prompt'].strip()}\n"
            prompt = f"{body}{RESPONSE_PREFIX}\n```python\n"
        return Instance(prompt=prompt, reference=r["canonical_solution"],
                        meta={"task_id": r["task_id"], "entry_point": r["entry_point"], "test": r["test"],
                              "code_prompt": r["code_prompt"], "complete_prompt": r["complete_prompt"],
                              "chat_prompt": body})

    def canonical_key(self, instance: Instance) -> str:
        return str(instance.meta["task_id"])

    # ----------------------------------------------------------------- grading
    def program(self, instance: Instance, completion: str) -> str:
        """The program graded for ``completion``: the answer's code (its first fenced block; without an
        opening fence, the text before a closing one, as after the raw ``instruct`` prompt's open fence)
        when it defines ``entry_point``; a fenced body after ``code_prompt``; otherwise the completion
        continues the raw ``complete`` prompt: ``complete_prompt + completion``."""
        entry = instance.meta["entry_point"]
        head = completion.split("```", 1)[0]
        if head != completion and _defines(head, entry):  # the code, then the fence the prompt opened
            return head
        code = extract_code(completion)
        fenced = code is not completion
        if _defines(code, entry):
            return code
        if fenced:
            return instance.meta["code_prompt"] + code
        return instance.meta["complete_prompt"] + completion

    def reference_program(self, instance: Instance) -> str:
        """The canonical solution as the official ground-truth check assembles it."""
        return instance.meta["complete_prompt"] + "\n" + instance.reference

    def run(self, instance: Instance, completion: str) -> UnittestResult:
        """The sandbox report of ``completion`` on the task's tests."""
        return self.run_program(instance, self.program(instance, completion))

    def run_program(self, instance: Instance, program: str) -> UnittestResult:
        """The sandbox report of a complete ``program`` on the task's tests."""
        return run_unittest(program, instance.meta["test"], env=self.env, timeout_s=self.timeout_s,
                            memory_mb=self.memory_mb, unsafe_exec=self.unsafe_exec, isolation=self.isolation)

    def score(self, instance: Instance, completion: str) -> float:
        return float(self.run(instance, completion).passed)

    def __repr__(self) -> str:
        return (f"BigCodeBenchTask(path={str(self.path)!r}, split={self.split!r}, subset={self.subset!r}, "
                f"n={self.eval_size}, env_missing={len(self.env_missing)})")


def _defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)
