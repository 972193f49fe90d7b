"""MBPP (sanitized) and the EvalPlus sets HumanEval+ / MBPP+, scored by running tests in the sandbox.

Every verdict goes through :func:`dlm_toolkit.tasks.code.check_solution`.

* ``mbpp``: Google's ``sanitized-mbpp.json`` (``task_id``, ``prompt``, ``code``, ``test_imports``,
  ``test_list``), test split task ids 11-510. Raw prompt: lm-eval's MBPP format (``You are an
  expert Python programmer, and here is your task: ... [BEGIN]``, stop ``[DONE]``); chat: the task,
  its tests and a request for a fenced code block. The program is the first fenced block of the
  answer (or the answer); the tests are the benchmark's asserts.
* ``humaneval_plus`` / ``mbpp_plus``: EvalPlus's ``HumanEvalPlus.jsonl`` / ``MbppPlus.jsonl``
  (``task_id``, ``prompt``, ``entry_point``, ``canonical_solution``, ``base_input``,
  ``plus_input``, ``atol``). The tests compare the candidate's output on every base and plus
  input with the canonical solution's, computed once per problem by running it in the sandbox
  (:func:`~dlm_toolkit.tasks.code.run_outputs`), exactly or within ``atol`` for floats, as
  EvalPlus does. EvalPlus's per-problem special oracles (e.g. any root for HumanEval/32, set
  equality for some MBPP+ problems) and its per-task input deserialisation (tuples) are not
  reproduced: inputs are plain JSON data; on those few problems our verdict can be stricter.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from dlm_toolkit.config import ConfigError

from .base import Instance
from .code import check_solution, code_limits, extract_code, output_tests, run_outputs
from .data import BenchmarkTask, DataError, DataSource, FiniteNumber, RowSchema, read_json_records, read_jsonl
from .sandbox import SandboxResult, check_isolation

__all__ = ["CodeTask", "HumanEvalPlusTask", "MBPPTask", "MBPPPlusTask", "called_function"]

MBPP_TEST_IDS = range(11, 511)
REFERENCE_CHUNK = 2000  # inputs per sandbox run of a canonical solution (EvalPlus problems have ~1000)
CODE_REQUEST = "Write the Python function in one ```python code block."


def called_function(tests: list[str], defined: set[str]) -> str | None:
    """The first function defined in ``defined`` that the asserts call (MBPP's entry point)."""
    for test in tests:
        try:
            tree = ast.parse(test)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in defined:
                return node.func.id
    return None


def _defined_functions(code: str) -> set[str]:
    try:
        return {n.name for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)}
    except SyntaxError:
        return set()


class CodeTask(BenchmarkTask):
    """A benchmark whose completions are programs checked by tests in the sandbox.

    Args:
        data, answer_length: see :class:`~dlm_toolkit.tasks.data.BenchmarkTask`.
        timeout_s / memory_mb: limits of each test run.
        unsafe_exec: run without bubblewrap where it is missing (process limits only); without
            it such a machine refuses before anything is decoded.
    """

    metric_name = "pass@1"
    _parallel_scoring = True

    def __init__(self, data: str | Path | None = None, answer_length: int = 512, timeout_s: float = 10.0,
                 memory_mb: int = 1024, unsafe_exec: bool = False) -> None:
        limits = code_limits(self.name, timeout_s=timeout_s, memory_mb=memory_mb)
        self.timeout_s, self.memory_mb, self.unsafe_exec = limits.timeout_s, limits.memory_mb, bool(unsafe_exec)
        self.isolation = check_isolation(unsafe_exec)
        super().__init__(data, answer_length)

    def program(self, instance: Instance, completion: str) -> str:
        """The candidate program for ``completion`` (defines the entry point)."""
        return extract_code(completion)

    def tests(self, instance: Instance) -> str:
        return instance.meta["tests"]

    def run(self, instance: Instance, completion: str) -> SandboxResult:
        """The sandbox report of ``completion`` on the instance's tests."""
        return check_solution(self.program(instance, completion), self.tests(instance), instance.meta["entry_point"],
                              timeout_s=self.timeout_s, memory_mb=self.memory_mb, unsafe_exec=self.unsafe_exec)

    def score(self, instance: Instance, completion: str) -> float:
        return float(self.run(instance, completion).passed)


class MBPPTask(CodeTask):
    """MBPP sanitized, test split (task ids 11-510; 257 problems in the sanitized release)."""

    name = "mbpp"
    description = "MBPP sanitized (lm-eval prompt, asserts in the sandbox), from a local sanitized-mbpp.json"
    source = DataSource(
        folder="mbpp", filename="sanitized-mbpp.json",
        fetch="mkdir -p data/mbpp && curl -fL -o data/mbpp/sanitized-mbpp.json "
              "https://raw.githubusercontent.com/google-research/google-research/master/mbpp/sanitized-mbpp.json",
        licence="CC BY 4.0 (google-research/mbpp)",
    )
    stop = ("[DONE]", "</s>", "<|im_end|>")

    class Record(RowSchema):
        """A record of ``sanitized-mbpp.json``: ``test_imports`` and ``test_list`` are lists of
        lines of code (a string there would be read one character per line)."""

        task_id: int
        prompt: str
        code: str
        test_list: Annotated[list[str], Field(min_length=1)]
        test_imports: list[str] | None = None

    def _load(self, path: Path) -> list[Instance]:
        out = []
        for row in read_json_records(path, self.Record):
            r = row.data
            if r["task_id"] not in MBPP_TEST_IDS:
                continue
            tests = r["test_list"]
            entry = called_function(tests, _defined_functions(r["code"]))
            if entry is None:
                raise DataError(f"{row.where}: no function of 'code' is called by 'test_list'")
            imports = list(r.get("test_imports") or [])
            listing = "\n".join(tests)
            out.append(Instance(
                prompt=(f"You are an expert Python programmer, and here is your task: {r['prompt']} "
                        f"Your code should pass these tests:\n\n{listing}\n[BEGIN]\n"),
                reference=str(r["code"]),
                meta={"task_id": r["task_id"], "entry_point": entry, "tests": "\n".join(imports + tests),
                      "chat_prompt": f"{r['prompt']}\nYour code should pass these tests:\n\n{listing}\n{CODE_REQUEST}"},
            ))
        return out

    def canonical_key(self, instance: Instance) -> str:
        return str(instance.meta["task_id"])


class _EvalPlusTask(CodeTask):
    """Shared by HumanEval+ and MBPP+: output-comparison tests against the canonical solution.

    Args:
        plus: test on the base and the plus inputs (default); ``False``: base inputs only.
    """

    reference_budget_s: float = 600.0
    """Time bound on computing one problem's reference outputs (all its sandbox runs together)."""

    def __init__(self, data: str | Path | None = None, answer_length: int = 512, timeout_s: float = 20.0,
                 memory_mb: int = 1024, unsafe_exec: bool = False, plus: bool = True) -> None:
        if not isinstance(plus, bool):
            raise ConfigError(f"task '{self.name}': plus: must be true or false (got {plus!r})")
        self.plus = plus
        self._expected: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        super().__init__(data, answer_length, timeout_s, memory_mb, unsafe_exec)

    class Record(RowSchema):
        """A line of EvalPlus's ``HumanEvalPlus.jsonl`` / ``MbppPlus.jsonl``: inputs are lists of
        argument lists, ``atol`` a finite tolerance >= 0."""

        task_id: str | int
        prompt: str
        entry_point: str
        canonical_solution: str
        base_input: list[list[Any]]
        plus_input: list[list[Any]]
        atol: Annotated[FiniteNumber, Field(ge=0)] | None = None

    def _load(self, path: Path) -> list[Instance]:
        out = []
        for row in read_jsonl(path, self.Record):
            r = row.data
            if not r["entry_point"].isidentifier():
                raise DataError(f"{row.where}: 'entry_point' {r['entry_point']!r} is not a name")
            out.append(self._instance(r))
        return out

    def _instance(self, r: dict[str, Any]) -> Instance:
        raise NotImplementedError

    def reference_program(self, instance: Instance) -> str:
        raise NotImplementedError

    def tests(self, instance: Instance) -> str:
        inputs = instance.meta["base_input"] + (instance.meta["plus_input"] if self.plus else [])
        key = f"{instance.meta['task_id']}|{self.plus}"
        with self._lock:
            expected = self._expected.get(key)
        if expected is None:  # the canonical solution runs once per problem
            expected = self._reference_outputs(instance, inputs)
            with self._lock:
                self._expected[key] = expected
        return output_tests(instance.meta["entry_point"], inputs, expected, instance.meta["atol"])

    def _reference_outputs(self, instance: Instance, inputs: list[list[Any]]) -> list[str]:
        """The canonical solution's outputs, :data:`REFERENCE_CHUNK` inputs per sandbox run, with a
        progress bar where there are several runs and a bound on the time of all of them.

        Raises:
            DataError: the problem's inputs take longer than :attr:`reference_budget_s`.
        """
        from tqdm.auto import tqdm

        program, entry = self.reference_program(instance), instance.meta["entry_point"]
        deadline = time.monotonic() + self.reference_budget_s
        outputs: list[str] = []
        with tqdm(total=len(inputs), desc=f"{instance.meta['task_id']}: reference outputs", unit="input",
                  leave=False, disable=True if len(inputs) <= REFERENCE_CHUNK else None) as bar:
            for start in range(0, len(inputs), REFERENCE_CHUNK):
                if start and time.monotonic() > deadline:  # a problem that fits one run is bounded by its timeout
                    raise DataError(f"task '{self.name}': {instance.meta['task_id']}: the canonical solution's outputs "
                                    f"on {len(inputs)} inputs took more than {self.reference_budget_s:g} s "
                                    f"({start} done); pass plus: false or a file with fewer plus_input rows")
                chunk = inputs[start:start + REFERENCE_CHUNK]
                outputs += run_outputs(program, entry, chunk, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                       unsafe_exec=self.unsafe_exec)
                bar.update(len(chunk))
        return outputs

    def canonical_key(self, instance: Instance) -> str:
        return str(instance.meta["task_id"])


def _meta(r: dict[str, Any]) -> dict[str, Any]:
    return {"task_id": str(r["task_id"]), "entry_point": str(r["entry_point"]), "base_input": r["base_input"],
            "plus_input": r["plus_input"], "atol": float(r.get("atol") or 0.0)}


class HumanEvalPlusTask(_EvalPlusTask):
    """HumanEval+ (EvalPlus): complete the function; the program is prompt + completion (raw), or
    the answer's code block (chat; prefixed by the prompt when it does not define the function)."""

    name = "humaneval_plus"
    description = "HumanEval+ (EvalPlus base + plus inputs, outputs vs canonical), from a local HumanEvalPlus.jsonl"
    source = DataSource(
        folder="evalplus", filename="HumanEvalPlus.jsonl",
        fetch="mkdir -p data/evalplus && curl -fL https://github.com/evalplus/humanevalplus_release/releases/download/"
              "v0.1.10/HumanEvalPlus.jsonl.gz | gunzip > data/evalplus/HumanEvalPlus.jsonl",
        licence="Apache-2.0 (evalplus); HumanEval: MIT (openai/human-eval)",
    )
    stop = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\nassert ", "</s>", "<|im_end|>")

    def _instance(self, r: dict[str, Any]) -> Instance:
        prompt = str(r["prompt"])
        return Instance(prompt=prompt, reference=str(r["canonical_solution"]),
                        meta={**_meta(r), "chat_prompt": f"Complete this Python function.\n```python\n{prompt}```\n{CODE_REQUEST}"})

    def program(self, instance: Instance, completion: str) -> str:
        code = extract_code(completion)
        if code is not completion and instance.meta["entry_point"] in _defined_functions(code):
            return code
        return instance.prompt + code

    def reference_program(self, instance: Instance) -> str:
        return instance.prompt + instance.reference


class MBPPPlusTask(_EvalPlusTask):
    """MBPP+ (EvalPlus): write the function the prompt describes; the program is the answer's code."""

    name = "mbpp_plus"
    description = "MBPP+ (EvalPlus base + plus inputs, outputs vs canonical), from a local MbppPlus.jsonl"
    source = DataSource(
        folder="evalplus", filename="MbppPlus.jsonl",
        fetch="mkdir -p data/evalplus && curl -fL https://github.com/evalplus/mbppplus_release/releases/download/"
              "v0.2.0/MbppPlus.jsonl.gz | gunzip > data/evalplus/MbppPlus.jsonl",
        licence="Apache-2.0 (evalplus); MBPP: CC BY 4.0",
    )
    stop = ("[DONE]", "\nif __name__", "\nprint(", "</s>", "<|im_end|>")

    def _instance(self, r: dict[str, Any]) -> Instance:
        prompt = str(r["prompt"]).strip()
        return Instance(prompt=f"You are an expert Python programmer, and here is your task:\n{prompt}\n[BEGIN]\n",
                        reference=str(r["canonical_solution"]),
                        meta={**_meta(r), "chat_prompt": f"{prompt}\n{CODE_REQUEST}"})

    def reference_program(self, instance: Instance) -> str:
        return instance.reference
