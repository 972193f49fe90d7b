"""Optuna sweeps over decoding policies, tracked in MLflow (experiment files: ``experiments/README.md``).

* :func:`load_experiment` — read and validate an experiment YAML (``experiments/README.md``);
* :func:`run_sweep` — run or resume a study until it holds ``n_trials`` finished trials;
* :func:`summarize` — the Pareto front of a study (:mod:`dlm_toolkit.sweep.pareto`);
* :func:`log_eval_run` — log one :func:`~dlm_toolkit.evaluation.evaluate.evaluate` result to MLflow.

The ``dlm sweep / pareto / replay`` commands live in :mod:`dlm_toolkit.commands.sweep`.
Names are imported lazily so that ``import dlm_toolkit.sweep`` stays cheap.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Experiment": "dlm_toolkit.sweep.experiment",
    "load_experiment": "dlm_toolkit.sweep.experiment",
    "run_sweep": "dlm_toolkit.sweep.study",
    "SweepResult": "dlm_toolkit.sweep.study",
    "load_study": "dlm_toolkit.sweep.storage",
    "summarize": "dlm_toolkit.sweep.pareto",
    "ParetoSummary": "dlm_toolkit.sweep.pareto",
    "log_eval_run": "dlm_toolkit.sweep.tracking",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dlm_toolkit.sweep' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
