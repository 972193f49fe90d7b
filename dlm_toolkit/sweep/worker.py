"""Sweep workers 1..K-1: the coordinator side (:func:`worker_command`, :func:`run_workers`,
:func:`dismiss`) and the worker process itself (:func:`worker_main`), started by ``run_sweep``
(``python -I``, an explicit import path) or by hand: ``python -m dlm_toolkit.sweep.worker [PAYLOAD_JSON]``.

Without an argument it imports the heavy libraries first, then reads the payload as one JSON
line from stdin, so its start-up overlaps the coordinator's checks; EOF means "not needed".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from dlm_toolkit.config import ConfigError
from dlm_toolkit.strategy.registry import imports_allowed, set_allow_imports
from dlm_toolkit.sweep.experiment import Experiment
from dlm_toolkit.sweep.params import make_pruner, make_sampler
from dlm_toolkit.sweep.storage import open_storage, optuna_quiet, quiet_storage_threads
from dlm_toolkit.sweep.tracking import Tracker
from dlm_toolkit.sweep.trials import Counts, TrialRunner

if TYPE_CHECKING:
    from dlm_toolkit.sweep.study import SweepProgress


def main(argv: list[str]) -> int:
    try:
        import mlflow  # noqa: F401  -- the slow imports, before waiting for orders
        import optuna  # noqa: F401
        import torch  # noqa: F401

        import dlm_toolkit.evaluation.evaluate  # noqa: F401
        line = argv[0] if argv else sys.stdin.readline()
        if not line.strip():
            return 0
        return worker_main(json.loads(line))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def worker_command() -> list[str]:
    """A worker's command line: ``python -I`` (no current folder, no ``PYTHON*`` variables, no user
    site on the import path, so a planted ``mlflow.py`` in the working folder is never imported)
    plus this process's import path, explicitly, minus the working folder."""
    cwd = os.getcwd()
    path = [p for p in sys.path if p and os.path.abspath(p) != cwd]
    boot = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from dlm_toolkit.sweep.worker import entry; entry()"
    return [sys.executable, "-I", "-c", boot, json.dumps(path)]


def run_workers(exp: Experiment, storage: str, tracking_uri: str, study_name: str, n_trials: int,
                 parent: str, procs: list[subprocess.Popen], heartbeat_interval: int, grace_period: int | None,
                 bar: SweepProgress, runner: TrialRunner, placement: list[str], dtype: str | None) -> Counts:
    """Worker 0 is this process (model and stores already open); ``procs`` are workers 1..K-1,
    started early by :func:`run_sweep` and waiting for their payload on stdin."""
    import torch

    threads = torch.get_num_threads()  # run_sweep set this process's share; each worker gets the same
    for k, proc in enumerate(procs, start=1):
        payload = {"experiment": exp.settings(), "source": str(exp.source) if exp.source else None,
                   "storage": storage, "tracking_uri": tracking_uri, "study_name": study_name,
                   "n_trials": n_trials, "parent_run_id": parent, "worker": k, "threads": threads,
                   "heartbeat_interval": heartbeat_interval, "grace_period": grace_period,
                   "device": placement[k], "dtype": dtype, "allow_import": imports_allowed(),
                   "reconnect_s": runner.reconnect_s}
        try:
            proc.stdin.write(json.dumps(payload) + "\n")
            proc.stdin.close()
        except (BrokenPipeError, OSError):  # it died while starting: the others carry on
            pass
    study = bar.study
    try:
        counts = runner.run(on_progress=bar.update)
        while any(p.poll() is None for p in procs):  # they stop at n_trials too; wait for their clean-up
            bar.update(Counts.of(study))
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        raise
    counts = Counts.of(study)
    bar.update(counts)
    bad = [(k, p.returncode) for k, p in enumerate(procs, start=1) if p.returncode != 0]
    if bad and counts.counted < n_trials:
        bar.write("workers exited with errors: " + ", ".join(f"worker {k}: exit {rc}" for k, rc in bad))
    return counts


def dismiss(procs: list[subprocess.Popen]) -> None:
    """Close the orders pipe of workers still waiting (they exit) and reap every worker."""
    for p in procs:
        if p.stdin and not p.stdin.closed:
            try:
                p.stdin.close()
            except OSError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker_main(payload: Mapping[str, Any]) -> int:
    """Entry of one worker process (``python -m dlm_toolkit.sweep.worker PAYLOAD_JSON``)."""
    import torch

    torch.set_num_threads(int(payload["threads"]))
    set_allow_imports(bool(payload.get("allow_import")))
    exp = Experiment.model_validate(payload["experiment"])
    if payload.get("source"):
        exp._source = Path(payload["source"])
    store = open_storage(payload["storage"], payload["heartbeat_interval"], payload["grace_period"])
    import optuna

    with optuna_quiet():
        study = optuna.load_study(study_name=payload["study_name"], storage=store, pruner=make_pruner(exp))
        study.sampler = make_sampler(exp, int(payload["worker"]), len(study.get_trials(deepcopy=False)))
    tracker = Tracker(payload["tracking_uri"], exp.mlflow_experiment)
    runner = TrialRunner(exp, study, payload["storage"], int(payload["n_trials"]), tracker,
                         payload["parent_run_id"], device=payload.get("device"), dtype=payload.get("dtype"),
                         reconnect_s=float(payload["reconnect_s"]))
    with quiet_storage_threads():
        runner.run()
    return 0


def entry(argv: list[str] | None = None) -> None:
    code = main(argv or [])
    sys.stdout.flush()
    sys.stderr.flush()
    # Every storage/tracking write is committed synchronously; skip the slow interpreter teardown
    # (torch, SQLAlchemy pools, MLflow) so the coordinator sees the worker finish promptly.
    os._exit(code)


if __name__ == "__main__":
    entry(sys.argv[1:])
