"""``dlm eval``: one policy on N eval instances of a task, quality and speed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dlm_toolkit.commands.common import (add_policy_args, add_runtime_args, add_task_args, check_cuda_graphs,
                                         load_for_args, policy_from_args, quiet_mlflow, task_options)
from dlm_toolkit.config import ConfigError


def cmd_eval(args: argparse.Namespace) -> int:
    from dlm_toolkit.evaluation.evaluate import check_n
    from dlm_toolkit.tasks import get_task

    check_cuda_graphs(args.cuda_graphs, [args.device])
    if args.n <= 0:
        raise ConfigError(f"--n: must be >= 1 (got {args.n})")
    if args.batch_size <= 0:
        raise ConfigError(f"--batch-size: must be >= 1 (got {args.batch_size})")
    task = get_task(args.task, **task_options(args))
    check_n(task, args.n)  # before the model loads
    policy = policy_from_args(args)
    from dlm_toolkit.models.oracle import is_oracle_spec

    if not (is_oracle_spec(args.checkpoint) or Path(args.checkpoint).is_dir()):  # oracle:TASK: an exact model
        raise ConfigError(f"--checkpoint {args.checkpoint}: folder does not exist")
    if args.tracking_uri:
        from dlm_toolkit.sweep.uris import check_sqlite_folder

        quiet_mlflow()  # MLflow would print its links to stdout, into --json's one object

        check_sqlite_folder(args.tracking_uri, "--tracking-uri")

    from dlm_toolkit.evaluation.evaluate import evaluate

    from dlm_toolkit.sweep.provenance import collect

    model, tokenizer = load_for_args(args, args.checkpoint)
    prov = collect(policy, model)
    result = evaluate(model, tokenizer, task, policy, args.n, args.seed, batch_size=args.batch_size,
                      progress=not args.no_progress, threads=args.threads, cuda_graphs=args.cuda_graphs)
    run_id = None
    from dlm_toolkit.models.distributed import is_main_process

    if args.tracking_uri and is_main_process():  # under torchrun every rank has the same result
        from dlm_toolkit.sweep.tracking import log_eval_run

        run_id = log_eval_run(result, policy, task.name, args.checkpoint, args.tracking_uri,
                              args.experiment_name, seed=args.seed, n=args.n, provenance=prov)
    m = result.metrics
    if args.json:
        print(json.dumps({**m, "accuracy_interval": list(result.accuracy_interval), "task": task.name,
                          "metric_name": task.metric_name, "seed": args.seed,
                          "batch_size": args.batch_size, "checkpoint": str(args.checkpoint),
                          "policy_hash": policy.config_hash(), "policy": policy.model_dump(mode="json"),
                          "mlflow_run_id": run_id, "provenance": prov, "chat": result.chat,
                          "instances": result.outcomes()}))
    else:
        lo, hi = result.accuracy_interval
        if result.chat:
            print("prompts           through the checkpoint's chat template")
        print(f"accuracy          {m['accuracy']:.4f}  [{lo:.4f}, {hi:.4f}] 95 % Wilson ({task.metric_name} on "
              f"{m['n']} {task.name} eval instances, seed {args.seed})")
        print(f"tpf               {m['tpf']:.3f}  (generated tokens up to and including the first EOS, per forward)")
        print(f"nfe_mean          {m['nfe_mean']:.2f}")
        print(f"tokens_per_second {m['tokens_per_second']:.1f}")
        print(f"edits_per_token   {m['edits_per_token']:.4f}")
        for key in sorted(k for k in m if k.startswith("accuracy_")):  # a task's per-group scores
            print(f"{key:<17} {m[key]:.4f}")
        print(f"policy            {policy.config_hash()}")
        if run_id:
            print(f"MLflow run {run_id} in {args.tracking_uri}" + run_link(args.tracking_uri, run_id))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    from dlm_toolkit.tasks import TASKS

    p = sub.add_parser("eval", help="evaluate one policy on a task",
                       description="Decode N eval instances of a task with a policy and report quality and "
                       "speed (TPF counts generated tokens up to and including the first EOS, per forward).")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder with tokenizer files")
    p.add_argument("--task", required=True, help=", ".join(sorted(TASKS)))
    add_policy_args(p)
    p.add_argument("--n", type=int, required=True, help="number of eval instances")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tracking-uri", help="log the evaluation as an MLflow run in this store")
    add_task_args(p)
    p.add_argument("--experiment-name", default="dlm-eval", help="MLflow experiment (default dlm-eval)")
    add_runtime_args(p)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval)


def run_link(tracking_uri: str, run_id: str) -> str:
    """``": <page>"`` for a run on a tracking server, else nothing (a SQLite store has no page until
    ``mlflow ui`` serves it)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return ""
    from mlflow import MlflowClient

    from dlm_toolkit.sweep.tracking import run_page_url
    from dlm_toolkit.sweep.uris import hide_web_password

    experiment_id = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
    return ": " + hide_web_password(run_page_url(tracking_uri, experiment_id, run_id))

