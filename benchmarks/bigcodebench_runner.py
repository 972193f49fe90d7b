"""Time per BigCodeBench problem in the sandbox: the canonical solutions of the shipped fixture
(tests/fixtures/bigcodebench) through ``run_unittest``, one at a time.

    .venv/bin/python benchmarks/bigcodebench_runner.py --repeats 5 --json

Each repeat grades every runnable task of the fixture (the one whose library is missing is left
out, as ``env_missing``); the median over repeats of the wall time per problem goes in the table of
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dlm_toolkit.tasks import get_task

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "bigcodebench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    task = get_task("bigcodebench", data=str(FIXTURE), timeout_s=60)
    problems = task.instances(task.eval_size, seed=0, split="eval")
    per_problem: list[float] = []
    failures = 0
    for _ in range(args.repeats):
        start = time.perf_counter()
        for p in problems:
            failures += not task.run_program(p, task.reference_program(p)).passed
        per_problem.append((time.perf_counter() - start) / len(problems))
    out = {"problems": len(problems), "repeats": args.repeats,
           "s/problem (median)": round(statistics.median(per_problem), 4),
           "s/problem (min)": round(min(per_problem), 4), "failures": failures}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
