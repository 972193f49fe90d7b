"""Time per HumanEval problem in the sandbox: the canonical solutions through ``run_tests`` (two
sandboxed processes, plain-data boundary) against the former single-process program through
``run_python`` (solution and tests in one process, which a wrong solution could fool).

    .venv/bin/python benchmarks/sandbox.py --workers 2 --repeats 3 --json

Each repeat scores all 164 canonical solutions both ways (interleaved, so machine load hits both
alike) and reports the wall time per problem; the medians over the repeats go in the table of
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from dlm_toolkit.tasks import get_task
from dlm_toolkit.tasks.sandbox import run_python, sandbox_info


def in_process(problem) -> str:
    """The program the harness ran before the boundary: prompt + solution + test + check(...)."""
    return (problem.prompt + problem.reference + "\n\n" + problem.meta["test"] + "\n\n"
            + f"check({problem.meta['entry_point']})\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="concurrent sandbox runs (threads)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    task = get_task("humaneval", timeout_s=10.0, memory_mb=512)
    problems = task.instances(164, seed=0, split="eval")
    runs: dict[str, list[float]] = {"run_tests": [], "run_python (one process)": []}
    failures = {name: 0 for name in runs}
    for _ in range(args.repeats):
        for name, one in (("run_tests", lambda p: task.run(p, p.reference).passed),
                          ("run_python (one process)", lambda p: run_python(in_process(p), 10.0, 512).passed)):
            start = time.perf_counter()
            with ThreadPoolExecutor(args.workers) as pool:
                passed = list(pool.map(one, problems))
            runs[name].append((time.perf_counter() - start) / len(problems))
            failures[name] += passed.count(False)
    info = sandbox_info()
    out = {"problems": len(problems), "workers": args.workers, "repeats": args.repeats,
           "isolation": "bwrap" if info.bwrap else "process", "per_run_uid": info.per_run_uid,
           **{f"{name} s/problem (median)": round(statistics.median(v), 4) for name, v in runs.items()},
           **{f"{name} failures": n for name, n in failures.items()}}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
