"""LiveCodeBench code generation (``livecodebench``), from the ``code_generation_lite`` release files.

Data: the release's JSONL files (``test.jsonl``, ``test2.jsonl`` ... ``test6.jsonl``), one problem a
line with the official fields (``question_title``, ``question_content``, ``platform``,
``question_id``, ``contest_id``, ``contest_date``, ``starter_code``, ``difficulty``,
``public_test_cases``, ``private_test_cases``, ``metadata``). ``data`` is the folder holding them
(the files of ``release_version`` are read, :data:`RELEASE_FILES`, as the official dataset script
maps ``release_v1`` .. ``release_v6``, ``release_latest``, ``vN`` and ``vN_vM``) or one JSONL file
(read whole). Problems are then kept by contest date as the official runner does:
``start_date <= contest_date <= end_date`` (``YYYY-MM-DD``, both optional).

Private tests are a JSON string, or ``base64(zlib(pickle(JSON string)))`` (the official encoding: a
pickled *string*, so its pickle never reads the memo): decoded by :mod:`.safe_pickle`, which never
unpickles an object, admits no memo read, and bounds the decompressed bytes (``max_test_mb``), the
opcodes and the containers; a problem has at most :data:`MAX_TESTS` tests, a call-based test at
most :data:`MAX_ARGS` arguments. Every check is linear in the bytes read. Every field is checked
when the file is read: a bad one is one line naming the file, the line, the question id and the
field.

Prompt: the official generic format (``lcb_runner/prompts/code_generation.py``): the system message,
``### Question:``, then with starter code "use the following starter code" and the code in a fence,
without it "read the inputs from stdin ... write the answer to stdout" and ``# YOUR CODE HERE``,
then ``### Answer: (use the provided format with backticks)``. The chat template gets the same text
as the user turn. The program is what lies between the last two lines holding a fence
(:func:`extract_code`, the official extraction; fewer than two: no program, a failure).

Grading (:mod:`.stdio`, as ``lcb_runner/evaluation/testing_util.py``): public then private tests in
order, the first failing one fails the problem; LeetCode problems (``metadata.func_name``) are
call-based, ``Solution().func_name(*args)`` with each input line a JSON argument, the result
``==`` the JSON output (JSON numbers parsed as the official grader parses them: integers exact,
decimals as floats); the others are stdin/stdout, compared line by line after stripping, as exact
``Decimal`` numbers where the text differs (never floats: two 21-digit integers differ). Time:
per test ``timeout_s`` (official default 6 s) + 1 s for the transfer, measured by the test side
from outside the candidate's process (the official grader's ``SIGALRM`` runs inside it, where
``except BaseException`` catches it; here no timer runs there, and a test not answered in time
fails, the candidate killed); a call-based solution's load is timed as one more test; whole run
``(timeout + 1) * tests + 5`` s. Everything runs in the bubblewrap sandbox, the verdict decided on
the test side of :func:`~.sandbox.run_tests`'s plain-data boundary. Limits of ours: a program may
print at most twice the expected output + 64 Ki characters (more is a failure, "flood", judged on the
test side: the candidate's own cap is one constant, so it learns nothing of the expected output); one test's
input or output crosses the sandbox boundary only up to 16 MiB encoded (larger: a failure).

Deliberate departures from the official grader, each what a real judge allows (one test each in
``tests/test_livecodebench_hostile.py``): ``quit()`` after the answer passes (the official
reliability guard sets ``builtins.quit = None``: a runtime error there; ``exit()`` and
``sys.exit()`` pass in both); ``sys.stdin.buffer`` works (the official stdin is a ``StringIO``
without one: a runtime error there); the per-test globals ``stdin``/``stdout`` are the redirected
streams (the official ``from sys import *`` binds the real ones). Iterating ``sys.stdin`` passes in
both (tested too, as agreement).

Missing libraries: the sandbox's interpreter may not be the evaluator's (``/usr/bin/python3``
stands in where the sandbox's users cannot read it, :func:`~.sandbox.runner.sandbox_python`; said
on stderr when the task is built). An answer that fails importing a library the evaluator's
interpreter has (numpy) is still a failure, but counted as ``env_missing`` (a metric, and one line
naming the interpreter and the libraries, :meth:`LiveCodeBenchTask.env_report`), never silently.

Metrics: pass@1 (one greedy completion per problem) as the task's score, and per difficulty and
platform through :meth:`LiveCodeBenchTask.extra_metrics` (``accuracy_easy``, ``accuracy_leetcode``, ...).
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import InputFileError, check_regular, parse_json

from .base import Instance
from .code import code_limits
from .data import DATA_ENV, DEFAULT_ROOT, BenchmarkTask, DataError, DataSource, _check_fields
from .safe_pickle import MAX_BLOB_BYTES
from .sandbox import SandboxResult, check_isolation, run_tests
from .sandbox.runner import sandbox_python
from .stdio import call_candidate, call_limit, call_tests, run_timeout, stdio_candidate, stdio_tests
from .livecodebench_records import (MAX_ARGS, MAX_TESTS, _choice, _date, _json_field, _Where,  # noqa: F401
                                    decode_private, parse_tests)

MAX_RELEASE_BYTES = 64 << 30  # one release file; the official ones are a few GB, read a line at a time
__all__ = ["FIELDS", "MAX_ARGS", "MAX_TESTS", "RELEASE_FILES", "LiveCodeBenchTask", "extract_code", "lcb_prompt", "parse_tests"]

_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")
RELEASE_FILES: dict[str, tuple[str, ...]] = {
    **{f"release_v{i}": _FILES[:i] for i in range(1, 7)},
    "release_latest": _FILES,
    **{f"v{i}": (_FILES[i - 1],) for i in range(1, 7)},
    **{f"v{i}_v{j}": _FILES[i - 1:j] for i in range(1, 7) for j in range(i + 1, 7)},
}
"""Release tag -> the files it reads (the official ``code_generation_lite`` dataset script's map)."""

FIELDS = ("question_title", "question_content", "platform", "question_id", "contest_id", "contest_date",
          "starter_code", "difficulty", "public_test_cases", "private_test_cases", "metadata")
PLATFORMS = ("leetcode", "codeforces", "atcoder")
DIFFICULTIES = ("easy", "medium", "hard")

SYSTEM_MESSAGE = ("You are an expert Python programmer. You will be given a question (problem specification) and "
                  "will generate a correct Python program that matches the specification and passes all tests. "
                  "You will NOT return anything except for the program.")
WITH_STARTER = ("You will use the following starter code to write the solution to the problem and enclose your "
                "code within delimiters.")
WITHOUT_STARTER = ("Read the inputs from stdin solve the problem and write the answer to stdout (do not directly "
                   "test on the sample inputs). Enclose your code within delimiters as follows.")

_FETCH = ("mkdir -p data/livecodebench && for f in " + " ".join(_FILES) + "; do curl -fL -o data/livecodebench/$f "
          "https://huggingface.co/datasets/livecodebench/code_generation_lite/resolve/main/$f; done")


_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([A-Za-z_][A-Za-z0-9_]*)")


def env_missing_module(reason: str) -> str | None:
    """The library a failed run could not import although the evaluator's own interpreter finds it
    (where the official grader runs the code): the sandbox's environment failed the answer, not the
    answer. ``None`` for any other failure, a module nobody has among them."""
    match = _NO_MODULE.search(reason)
    if match is None:
        return None
    try:  # a top-level name: looked up on sys.path, never imported (the name came from the candidate)
        found = importlib.util.find_spec(match.group(1)) is not None
    except (ImportError, ValueError):
        found = False
    return match.group(1) if found else None


def lcb_prompt(question: str, starter_code: str) -> str:
    """The official generic prompt (system message, question, format, answer cue)."""
    text = f"### Question:\n{question}\n\n"
    if starter_code:
        text += f"### Format: {WITH_STARTER}\n```python\n{starter_code}\n```\n\n"
    else:
        text += f"### Format: {WITHOUT_STARTER}\n```python\n# YOUR CODE HERE\n```\n\n"
    return f"{SYSTEM_MESSAGE}\n\n{text}### Answer: (use the provided format with backticks)\n\n"


def extract_code(completion: str) -> str:
    """The official extraction: the lines between the last two lines holding a fence; ``""`` when
    fewer than two lines hold one."""
    lines = completion.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    if len(fences) < 2:
        return ""
    return "\n".join(lines[fences[-2] + 1:fences[-1]])


class LiveCodeBenchTask(BenchmarkTask):
    """LiveCodeBench code generation, pass@1 in the sandbox (see the module docstring).

    Args:
        data: the folder holding the release files, or one JSONL file (default:
            ``$DLM_DATA_DIR/livecodebench`` or ``./data/livecodebench``).
        release_version: which release files a folder contributes (:data:`RELEASE_FILES`).
        start_date / end_date: keep problems with ``start_date <= contest_date <= end_date``.
        answer_length: generation budget in tokens.
        timeout_s: per-test timeout (official default 6 s).
        memory_mb: address-space limit of each sandboxed process.
        max_test_mb: bound on one problem's decompressed private tests.
        unsafe_exec: run without bubblewrap where it is missing (process limits only).
    """

    name = "livecodebench"
    description = "LiveCodeBench code generation (official prompt and grader, sandboxed), from local release files"
    metric_name = "pass@1"
    source = DataSource(folder="livecodebench", filename="test.jsonl", fetch=_FETCH,
                        licence="see the livecodebench/code_generation_lite dataset card")
    stop = ("</s>", "<|im_end|>")
    _parallel_scoring = True

    def __init__(self, data: str | Path | None = None, release_version: str = "release_v6",
                 start_date: str | None = None, end_date: str | None = None, answer_length: int = 1024,
                 timeout_s: float = 6.0, memory_mb: int = 2048, max_test_mb: int = MAX_BLOB_BYTES >> 20,
                 unsafe_exec: bool = False) -> None:
        if release_version not in RELEASE_FILES:
            raise ConfigError(f"release_version: {release_version!r} is not one of {', '.join(RELEASE_FILES)}")
        if isinstance(answer_length, bool) or not isinstance(answer_length, int) or answer_length <= 0:
            raise ConfigError(f"answer_length: must be an integer >= 1 (got {answer_length!r})")
        limits = code_limits(self.name, timeout_s=timeout_s, memory_mb=memory_mb, max_test_mb=max_test_mb)
        self.release_version, self.answer_length = release_version, answer_length
        self.start, self.end = _date(start_date, "start_date"), _date(end_date, "end_date")
        self.timeout_s, self.memory_mb = limits.timeout_s, limits.memory_mb
        self.max_test_bytes = int(limits.max_test_mb * (1 << 20))
        self.unsafe_exec = bool(unsafe_exec)
        self.isolation = check_isolation(unsafe_exec)
        self.sandbox_python = sandbox_python(self.isolation)
        self.env_missing: dict[str, str] = {}
        """Question id -> the library its latest scored answer failed to import in the sandbox
        though the evaluator's interpreter has it (:func:`env_missing_module`)."""
        self.files = self._files(data)
        self.path = self.files[0]
        self._instances = [inst for path in self.files for inst in self._read(path)]
        if not self._instances:
            raise DataError(f"task '{self.name}': no problem of {', '.join(map(str, self.files))} lies in the "
                            f"contest dates {start_date or '-'} .. {end_date or '-'}")
        self.eval_size = len(self._instances)
        if os.path.realpath(self.sandbox_python) != os.path.realpath(sys.executable):
            print(f"livecodebench: the sandbox runs {self.sandbox_python}, not the evaluator's {sys.executable} (which "
                  "its users cannot read): an answer importing a library only the latter has fails and is counted as "
                  "env_missing", file=sys.stderr)

    # ----------------------------------------------------------------- data
    def _files(self, data: str | Path | None) -> list[Path]:
        if data is not None and str(data) != "":
            folder, where = Path(data).expanduser(), "data"
            if folder.exists() and not folder.is_dir():
                return [folder]  # one release file: checked as every file is, in _read
        else:
            root = os.environ.get(DATA_ENV) or DEFAULT_ROOT
            folder = Path(root).expanduser() / self.source.folder
            where = f"${DATA_ENV}" if os.environ.get(DATA_ENV) else f"default data folder ./{DEFAULT_ROOT}"
        files = [folder / name for name in RELEASE_FILES[self.release_version]]
        missing = [p for p in files if not p.is_file()]
        if missing:
            present = [name for name in RELEASE_FILES if all((folder / f).is_file() for f in RELEASE_FILES[name])]
            other = (f"; the files there make up {', '.join(present)}: pick one with --task-arg release_version=NAME "
                     "(task_args: {release_version: NAME})") if present else ""
            raise DataError(f"task '{self.name}': {self.release_version} needs {', '.join(map(str, missing))} "
                            f"({where}); put them there with: {self.source.fetch} (licence: {self.source.licence}), "
                            f"or pass --data PATH (the folder, or one JSONL file){other}")
        return files

    @property
    def max_line_bytes(self) -> int:
        """The longest problem line read: its encoded private tests at the size bound, plus 1 MiB."""
        return 2 * self.max_test_bytes + (1 << 20)

    def _line(self, f: Any, where: _Where) -> bytes:
        raw = f.readline(self.max_line_bytes + 1)
        if len(raw) > self.max_line_bytes:
            raise DataError(f"{where.path}:{where.line}: a line longer than {self.max_line_bytes} bytes "
                            f"(max_test_mb={self.max_test_bytes >> 20} bounds it)")
        return raw

    def _read(self, path: Path) -> list[Instance]:
        # streamed line by line (release files run to gigabytes), so only the file's kind is checked here, as
        # the shared data reader checks it: a FIFO, a device or a /proc file that reports size 0 is refused
        try:
            size = check_regular(path, MAX_RELEASE_BYTES, "a LiveCodeBench release file")
        except InputFileError as err:
            raise DataError(str(err)) from None
        if size == 0:
            raise DataError(f"{path}: a LiveCodeBench release file of size 0 (empty, or a /proc or /sys file that "
                            "is never read): no problems")
        out = []
        with path.open("rb") as f:
            number = 0
            while True:
                offset = f.tell()
                raw = self._line(f, _Where(path, number + 1))
                if not raw:
                    break
                number += 1
                if raw.strip():
                    inst = self._parse(raw, _Where(path, number), offset)
                    if inst is not None:
                        out.append(inst)
        return out

    def _record(self, raw: bytes, where: _Where) -> dict[str, Any]:
        try:  # the shared parser: UTF-8 and the nesting depth checked before json decodes it
            record = parse_json(raw, f"{where.path}:{where.line}")
        except InputFileError as exc:
            raise DataError(f"{exc} (a JSON line)") from None
        _check_fields(record, FIELDS, f"{where.path}:{where.line}")
        for field in ("question_title", "question_content", "question_id", "contest_date", "starter_code"):
            if not isinstance(record[field], str):
                raise where.error(field, f"must be a string, found {type(record[field]).__name__}")
        return record

    def _parse(self, raw: bytes, where: _Where, offset: int) -> Instance | None:
        r = self._record(raw, where)
        where = _Where(where.path, where.line, r["question_id"])
        try:
            date = datetime.fromisoformat(r["contest_date"]).replace(tzinfo=None)
        except ValueError:
            raise where.error("contest_date", f"{r['contest_date']!r} is not an ISO date") from None
        platform = _choice(r, "platform", PLATFORMS, where)
        difficulty = _choice(r, "difficulty", DIFFICULTIES, where)
        metadata = _json_field(r, "metadata", where)
        if not isinstance(metadata, dict):
            raise where.error("metadata", f"must hold a JSON object, found {type(metadata).__name__}")
        func_name = metadata.get("func_name")
        if func_name is not None and not (isinstance(func_name, str) and func_name.isidentifier()):
            raise where.error("metadata", f"func_name {func_name!r} is not a Python identifier")
        public = parse_tests(_json_field(r, "public_test_cases", where), where, "public_test_cases", func_name)
        private = parse_tests(decode_private(r["private_test_cases"], where, self.max_test_bytes), where,
                              "private_test_cases", func_name, MAX_TESTS - len(public))
        if not public and not private:
            raise where.error("public_test_cases", "the problem has no test at all")
        if (self.start is not None and date < self.start) or (self.end is not None and date > self.end):
            return None
        prompt = lcb_prompt(r["question_content"], r["starter_code"])
        return Instance(prompt=prompt, reference="", meta={
            "question_id": r["question_id"], "platform": platform, "difficulty": difficulty,
            "contest_date": date.isoformat(), "func_name": func_name, "public": public, "n_private": len(private),
            "source": (str(where.path), offset, where.line), "chat_prompt": prompt,
        })

    def cases(self, instance: Instance) -> list[tuple[Any, Any]]:
        """Public then private tests of ``instance`` (the private ones re-read from the file, so a
        whole release is never held decoded in memory)."""
        path, offset, line = instance.meta["source"]
        where = _Where(Path(path), line, instance.meta["question_id"])
        with open(path, "rb") as f:
            f.seek(offset)
            record = self._record(self._line(f, where), where)
        private = parse_tests(decode_private(record["private_test_cases"], where, self.max_test_bytes), where,
                              "private_test_cases", instance.meta["func_name"],
                              MAX_TESTS - len(instance.meta["public"]))
        return list(instance.meta["public"]) + private

    # ----------------------------------------------------------------- scoring
    def programs(self, instance: Instance, completion: str) -> tuple[str, str, str, int]:
        """``(candidate program, test program, entry point, number of timed calls)`` for ``completion``."""
        code, cases, func = extract_code(completion), self.cases(instance), instance.meta["func_name"]
        if func is None:
            return stdio_candidate(code), stdio_tests(cases), "run_stdio", len(cases)
        return call_candidate(code, func), call_tests(cases), "run_call", len(cases) + 1  # the load is timed as a test

    def run(self, instance: Instance, completion: str) -> SandboxResult:
        """The sandbox report of ``completion`` on all of the instance's tests."""
        candidate, tests, entry, n = self.programs(instance, completion)
        return run_tests(candidate, tests, entry, timeout_s=run_timeout(self.timeout_s, n), memory_mb=self.memory_mb,
                         unsafe_exec=self.unsafe_exec, isolation=self.isolation,
                         call_timeout_s=call_limit(self.timeout_s))

    def score(self, instance: Instance, completion: str) -> float:
        qid = str(instance.meta["question_id"])
        if not extract_code(completion).strip():
            self.env_missing.pop(qid, None)
            return 0.0  # no fenced program: nothing to run
        result = self.run(instance, completion)
        module = None if result.passed else env_missing_module(result.reason)
        if module is None:
            self.env_missing.pop(qid, None)
        else:  # still a failure (the answer did not run here), but counted and named, never silent
            self.env_missing[qid] = module
        return float(result.passed)

    def env_report(self, instances: Sequence[Instance]) -> str:
        """One line: how many of ``instances`` failed on a library the sandbox lacks, which, and where."""
        counts = Counter(self.env_missing[q] for q in (str(i.meta["question_id"]) for i in instances)
                         if q in self.env_missing)
        if not counts:
            return "env_missing: 0 problems"
        modules = ", ".join(f"{m} ({c})" for m, c in counts.most_common())
        return (f"env_missing: {sum(counts.values())} problem(s) scored as failures because the sandbox's interpreter "
                f"({self.sandbox_python}) lacks a library the evaluator's ({sys.executable}) has: {modules}; install "
                "them for that interpreter, or let the sandbox's users read the evaluator's")

    def extra_metrics(self, instances: Sequence[Instance], scores: Sequence[float],
                      completions: Sequence[str] = ()) -> dict[str, float]:
        """pass@1 per difficulty and per platform present: ``accuracy_<difficulty>``, ``accuracy_<platform>``;
        ``env_missing``: how many of ``instances`` failed only for a library the sandbox lacks (the
        line of :meth:`env_report` goes to stderr when there are any)."""
        groups: dict[str, list[float]] = {}
        for inst, score in zip(instances, scores):
            for key in (inst.meta["difficulty"], inst.meta["platform"]):
                groups.setdefault(f"accuracy_{key}", []).append(float(score))
        metrics = {k: sum(v) / len(v) for k, v in sorted(groups.items())}
        missing = sum(str(i.meta["question_id"]) in self.env_missing for i in instances)
        if missing:
            print(f"livecodebench: {self.env_report(instances)}", file=sys.stderr)
        return {**metrics, "env_missing": float(missing)}

    def canonical_key(self, instance: Instance) -> str:
        return str(instance.meta["question_id"])

    def __repr__(self) -> str:
        return (f"LiveCodeBenchTask(files={[str(p) for p in self.files]!r}, release_version={self.release_version!r}, "
                f"n={self.eval_size}, timeout_s={self.timeout_s}, isolation={self.isolation!r})")
