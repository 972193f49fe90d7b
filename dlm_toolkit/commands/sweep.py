"""``dlm sweep``, ``dlm pareto`` and ``dlm replay``: :func:`register` adds them.

Heavy imports (torch, Optuna, MLflow) happen inside the commands so ``dlm --help`` stays fast.
Bad input raises :class:`~dlm_toolkit.config.ConfigError` (exit 2, one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from dlm_toolkit.commands.common import (add_cuda_graphs_arg, add_import_arg, add_runtime_args, check_cuda_graphs,
                                         load_for_args, parse_sets, quiet_mlflow)
from dlm_toolkit.config import ConfigError
from dlm_toolkit.sweep.attrs import read_settings, trial_metrics, trial_plugin_hashes, trial_policy
from dlm_toolkit.sweep.storage import DEFAULT_HEARTBEAT, DEFAULT_RECONNECT, DEFAULT_STORAGE, DEFAULT_TRACKING_URI
# Metrics compared by `dlm replay`; wall time and tokens/s depend on the machine's load.
DETERMINISTIC_METRICS = ("accuracy", "tpf", "nfe_mean", "edits_per_token", "remasks_per_token",
                         "forward_tokens_per_token", "inserts_per_token", "deletes_per_token", "n")
TIMING_METRICS = ("tokens_per_second", "wall_time_s")
MLFLOW_UI_PORT = 5000  # `mlflow ui`'s default; the printed links of a local store assume it


def register(sub: Any) -> None:
    """Add the sweep, pareto and replay subcommands to ``dlm``'s subparsers."""

    p = sub.add_parser("sweep", help="Optuna search of decoding policies (speed-quality Pareto front)",
                       description="Run (or resume) an Optuna study over the search space of an experiment "
                       "file; every trial is logged in MLflow. Rerunning the same command resumes it.")
    p.add_argument("experiment", help="experiment YAML (see experiments/README.md)")
    p.add_argument("--n-trials", type=int, help="target total of finished trials (default: n_trials in the file)")
    p.add_argument("--storage", default=DEFAULT_STORAGE, help=f"Optuna storage URL (default {DEFAULT_STORAGE})")
    p.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI,
                   help=f"MLflow tracking URI (default {DEFAULT_TRACKING_URI})")
    p.add_argument("--study-name", help="default: the experiment's name (or file stem)")
    p.add_argument("--workers", type=int, default=1, help="processes evaluating trials in parallel")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a base-policy key, repeatable")
    p.add_argument("--heartbeat", type=int, default=DEFAULT_HEARTBEAT, metavar="SECONDS",
                   help="trial heartbeat; a trial silent for 3x this is considered dead and retried")
    p.add_argument("--reconnect", type=float, default=DEFAULT_RECONNECT, metavar="SECONDS",
                   help="how long workers wait for a storage that stopped answering before giving up "
                        "(exit 2; finished trials are kept, the same command continues)")
    p.add_argument("--threads", type=int, help="torch CPU threads per worker (default: torch's choice; "
                   "cpu_count/K with --workers K); tiny models decode fastest with 1")
    p.add_argument("--device", help="where every worker loads the model: cpu (default), cuda or cuda:N")
    p.add_argument("--dtype", help="weight dtype: float32 (CPU default), bfloat16 (GPU default) or float16")
    p.add_argument("--devices", help="one worker per device, comma-separated (e.g. cuda:0,cuda:1)")
    add_cuda_graphs_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the front as JSON instead of a table")
    p.add_argument("--verbose", action="store_true",
                   help="also print MLflow's own run and experiment links (two per trial with a tracking server)")
    add_import_arg(p)
    add_unsafe_exec_arg(p)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("pareto", help="print the Pareto front of a study (--log: also log it to MLflow)",
                       description="The front of a sweep study: each trial's params, quality, TPF and whether "
                       "it dominates each preset. Reads only; with --log it also logs pareto.png/.csv/.json "
                       "and metrics to the study's MLflow parent run (as `dlm sweep` does when it ends).")
    p.add_argument("--storage", default=DEFAULT_STORAGE)
    p.add_argument("--study-name", required=True)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI,
                   help="with --log: MLflow store holding the study's parent run (skipped if its SQLite file is absent)")
    p.add_argument("--log", action="store_true", help="log the front to the study's MLflow parent run")
    p.add_argument("--no-log", action="store_true",
                   help="deprecated (not logging is the default now); accepted until 0.3.0")
    p.add_argument("--out", help="also write pareto.png, pareto.html, pareto.csv and pareto.json into this folder")
    p.set_defaults(func=cmd_pareto)

    p = sub.add_parser("replay", help="re-run one trial's exact policy and compare its metrics",
                       description="Re-evaluate a trial's stored policy JSON with the study's stored settings "
                       "(checkpoint, task, n, seed, batch size); exit 0 when the deterministic metrics match.")
    p.add_argument("--storage", default=DEFAULT_STORAGE)
    p.add_argument("--study-name", required=True)
    p.add_argument("--trial", type=int, required=True, help="trial number")
    p.add_argument("--json", action="store_true")
    add_import_arg(p)
    add_runtime_args(p)
    add_unsafe_exec_arg(p)
    p.set_defaults(func=cmd_replay)


def add_unsafe_exec_arg(p: Any) -> None:
    """``--unsafe-exec``: the only way a sweep or a replay lets a code task run without bubblewrap
    (an experiment file or a study store never grants it)."""
    p.add_argument("--unsafe-exec", action="store_true",
                   help="code tasks: where the bubblewrap sandbox is unavailable, run generated code with "
                        "process-level limits only (default: refuse; never read from a file or a store)")


# -- sweep -------------------------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace) -> int:
    from dlm_toolkit.sweep.experiment import load_experiment
    from dlm_toolkit.sweep.pareto import format_table
    from dlm_toolkit.sweep.study import run_sweep

    quiet_mlflow(args.verbose)
    exp = load_experiment(args.experiment, parse_sets(args.set), unsafe_exec=args.unsafe_exec,
                          allow_import=args.allow_import)
    if args.cuda_graphs is not None:  # the flag wins over the experiment's cuda_graphs key
        exp = exp.model_copy(update={"cuda_graphs": args.cuda_graphs})
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else [args.device or exp.device]
    check_cuda_graphs(exp.cuda_graphs, devices, "--cuda-graphs" if args.cuda_graphs else "cuda_graphs: true")
    if args.heartbeat < 1:
        raise ConfigError(f"--heartbeat: must be >= 1 second (got {args.heartbeat})")
    result = run_sweep(exp, args.n_trials, storage=args.storage, tracking_uri=args.tracking_uri,
                       study_name=args.study_name, workers=args.workers, progress=not args.no_progress,
                       heartbeat_interval=args.heartbeat, threads=args.threads, device=args.device,
                       reconnect_s=args.reconnect,
                       dtype=args.dtype, devices=[d.strip() for d in args.devices.split(",")] if args.devices else None)
    if args.json:
        print(json.dumps({**result.summary.to_json(), "storage": args.storage, "tracking_uri": args.tracking_uri,
                          "parent_run_id": result.parent_run_id, "finished_trials": result.counts.counted,
                          "n_trials": result.n_trials}, default=str))
    else:
        print(format_table(result.summary))
        print()
        c = result.counts
        print(f"study '{result.study_name}': {c.counted}/{result.n_trials} finished trials "
              f"({c.complete} complete, {c.pruned} pruned, {c.failed} failed)"
              + (" -- the grid is exhausted" if result.exhausted and c.counted < result.n_trials else "")
              + (" -- already finished, nothing ran (--n-trials N adds trials)" if result.already_finished else "")
              + ("" if result.complete else " -- rerun the same command to resume"))
        print(open_hints(args.storage, args.tracking_uri, result.study_name, result.experiment_id,
                         result.parent_run_id))
    return 0 if result.complete else 1


def open_hints(storage: str, tracking_uri: str, study_name: str, experiment_id: str = "", run_id: str = "") -> str:
    """Where to look next: the parent run's page in MLflow's machine-learning view, the runs table
    with the metric columns chosen, the Optuna dashboard and the front table."""
    from dlm_toolkit.sweep.tracking import run_page_url, runs_table_url
    from dlm_toolkit.sweep.uris import hide_password, hide_web_password

    served = tracking_uri.startswith(("http://", "https://"))
    base = tracking_uri.rstrip("/") if served else f"http://127.0.0.1:{MLFLOW_UI_PORT}"
    page = hide_web_password(run_page_url(base, experiment_id, run_id) if run_id else base)
    mlflow = (f"MLflow:  open {page}" if served else
              f"MLflow:  mlflow ui --backend-store-uri {tracking_uri} --workers 1   then open {page}\n"
              f"         ({MLFLOW_UI_PORT} is mlflow ui's default port; with `mlflow ui --port N` use port N in "
              "these links)")
    lines = [mlflow + f"   (parent run 'study-{study_name}')"]
    if experiment_id:
        lines.append(f"         runs table with accuracy, tpf and nfe_mean columns: "
                     f"{hide_web_password(runs_table_url(base, experiment_id))}")
    return "\n".join([
        *lines,
        f"Optuna:  optuna-dashboard {hide_password(storage)}   (pip install optuna-dashboard)",
        f"Front:   dlm pareto --storage {hide_password(storage)} --study-name {study_name}",
    ])


# -- pareto ------------------------------------------------------------------------------------
def cmd_pareto(args: argparse.Namespace) -> int:
    from dlm_toolkit.sweep.pareto import format_table, summarize, write_all
    from dlm_toolkit.sweep.storage import load_study
    from dlm_toolkit.sweep.uris import check_sqlite_folder, check_store_kind

    if args.no_log:
        print("note: --no-log is deprecated and will be removed in 0.3.0: `dlm pareto` no longer logs "
              "unless --log", file=sys.stderr)
        if args.log:
            raise ConfigError("--log and --no-log: choose one")
    if args.log:  # before anything is opened: a refused command writes nothing
        check_sqlite_folder(args.tracking_uri, "tracking URI")
        check_store_kind(args.tracking_uri, "tracking URI", "mlflow")
    study = load_study(args.storage, args.study_name)
    summary = summarize(study)
    logged = None
    if args.log:
        logged = log_pareto_to_parent(summary, study, args.storage, args.tracking_uri)
    if args.out:
        write_all(summary, args.out)
    if args.json:
        print(json.dumps({**summary.to_json(), "mlflow_parent_run_id": logged}, default=str))
    else:
        print(format_table(summary))
        if logged:
            print(f"logged pareto.png/.csv/.json and metrics to MLflow run {logged} ({args.tracking_uri})")
    return 0


def log_pareto_to_parent(summary: Any, study: Any, storage: str, tracking_uri: str) -> str | None:
    """Log the front to the study's parent run; None (with a note) when there is none."""
    from dlm_toolkit.sweep.tracking import Tracker
    from dlm_toolkit.sweep.uris import sqlite_file

    db = sqlite_file(tracking_uri) if tracking_uri.startswith("sqlite") else None
    if db is not None and not db.exists():
        print(f"note: {tracking_uri} does not exist; nothing logged to MLflow", file=sys.stderr)
        return None
    settings = read_settings(study) or {}
    tracker = Tracker(tracking_uri, settings.get("mlflow_experiment", "dlm-sweep"))
    run_id = tracker.find_parent(study.study_name, storage, all_experiments=True)
    if run_id is None:
        print(f"note: no MLflow parent run for study '{study.study_name}' in {tracking_uri}; nothing logged",
              file=sys.stderr)
        return None
    tracker.log_pareto(run_id, summary, study)
    return run_id


# -- replay ------------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    check_cuda_graphs(args.cuda_graphs, [args.device])
    out = replay(args.storage, args.study_name, args.trial, load=lambda path: load_for_args(args, path),
                 threads=args.threads, cuda_graphs=args.cuda_graphs, unsafe_exec=args.unsafe_exec,
                 allow_import=args.allow_import)
    for warning in out["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"trial {out['trial']} of study '{out['study_name']}' (policy {out['policy_hash']}, "
              f"{out['task']}, n={out['n']}, seed={out['seed']})")
        for k, v in out["metrics"].items():
            stored = out["stored"].get(k)
            mark = "" if k in TIMING_METRICS else ("  ok" if k not in out["mismatches"] else "  MISMATCH")
            print(f"  {k:<18} {v:<12.6g} stored {stored if stored is None else format(stored, '.6g'):<12}{mark}")
        print("match" if out["match"] else "MISMATCH in " + ", ".join(out["mismatches"]),
              "(timing metrics are not compared)")
    return 0 if out["match"] else 1


def replay(storage: str, study_name: str, number: int, load: Callable[[str], tuple[Any, Any]] | None = None,
           threads: int | None = None, cuda_graphs: bool | None = None, unsafe_exec: bool = False,
           allow_import: bool = False) -> dict[str, Any]:
    """Re-evaluate trial ``number``'s stored policy with the study's settings; compare metrics.
    ``load``: checkpoint folder -> (model, tokenizer) (default: :func:`load_checkpoint` on the CPU);
    ``threads``, ``cuda_graphs``: as :func:`~dlm_toolkit.evaluation.evaluate.evaluate`'s (graphs change no
    metric but the timing ones). ``unsafe_exec`` (``--unsafe-exec``) and ``allow_import``
    (``--allow-import``) are the only sources of those privileges: a store whose ``task_args`` ask
    for one is refused without its flag, before anything runs."""
    from dlm_toolkit.evaluation.evaluate import evaluate, load_checkpoint
    from dlm_toolkit.sweep.storage import load_study
    from dlm_toolkit.tasks import get_task

    study = load_study(storage, study_name)
    settings = read_settings(study)  # validated: the experiment file's schema, the task's arguments, n
    if not settings:
        raise ConfigError(f"study {study_name!r} has no stored experiment settings (not made by `dlm sweep`)")
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    trial = trials.get(number)
    if trial is None:
        raise ConfigError(f"--trial {number}: no such trial in study {study_name!r} (trials 0..{len(trials) - 1})")
    policy = trial_policy(trial)
    if policy is None:
        error = trial.user_attrs.get("error")
        error = error[:300] if isinstance(error, str) else None
        raise ConfigError(f"--trial {number}: trial has no stored policy (state {trial.state.name}"
                          + (f", error: {error}" if error else "") + ")")
    from dlm_toolkit.sweep.provenance import changed_plugins, collect, plugin_hashes

    warnings = changed_plugins(trial_plugin_hashes(trial), plugin_hashes(collect(policy)))
    from dlm_toolkit.sweep.experiment import PRIVILEGED_TASK_ARGS, _takes

    task_args = dict(settings["task_args"])
    granted = {"unsafe_exec": unsafe_exec, "allow_import": allow_import}
    asked = [k for k in PRIVILEGED_TASK_ARGS if task_args.pop(k, False) not in (False, None) and not granted[k]]
    if asked:
        what = {"unsafe_exec": "to run generated code without bubblewrap",
                "allow_import": "for lm-eval to import Python from task files"}[asked[0]]
        raise ConfigError(f"study {study_name!r}: stored task_args.{asked[0]} asks {what}; a store never grants "
                          f"that: pass `dlm replay {PRIVILEGED_TASK_ARGS[asked[0]]}` to allow it")
    for key, flag in granted.items():
        if flag and _takes(settings["task"], key):
            task_args[key] = True
    try:
        task = get_task(settings["task"], **task_args)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"study {study_name!r}: stored task_args: {err}") from None
    model, tokenizer = (load or load_checkpoint)(settings["model"])
    result = evaluate(model, tokenizer, task, policy, settings["n"], settings["seed"],
                      batch_size=settings["batch_size"], progress=False, threads=threads, cuda_graphs=cuda_graphs)
    stored = trial_metrics(trial)
    metrics = {k: float(v) for k, v in result.metrics.items()}
    mismatches = [k for k in DETERMINISTIC_METRICS
                  if k in stored and abs(float(stored[k]) - metrics[k]) > 1e-9 * max(1.0, abs(metrics[k]))]
    if not stored:
        mismatches = ["(no stored metrics: trial state " + trial.state.name + ")"]
    return {"study_name": study_name, "trial": number, "state": trial.state.name, "policy_hash": policy.config_hash(),
            "task": settings["task"], "n": settings["n"], "seed": settings["seed"], "checkpoint": settings["model"],
            "metrics": metrics, "stored": stored, "mismatches": mismatches, "match": not mismatches,
            "compared": [k for k in DETERMINISTIC_METRICS if k in stored], "warnings": warnings}
