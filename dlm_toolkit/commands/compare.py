"""``dlm compare``: two policies on the same eval instances, with the paired difference.

Both policies decode the same ``n`` instances (same seed, so the same per-instance random
streams); the comparison is instance by instance (:func:`dlm_toolkit.evaluation.stats.compare_outcomes`):
exact McNemar for accuracy, paired bootstrap intervals for the accuracy and TPF differences.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dlm_toolkit.commands.common import (add_import_arg, add_runtime_args, add_task_args, check_cuda_graphs,
                                         load_for_args, parse_sets, task_options)
from dlm_toolkit.config import ConfigError


def cmd_compare(args: argparse.Namespace) -> int:
    from dlm_toolkit.evaluation.evaluate import check_n, evaluate
    from dlm_toolkit.strategy.policy_config import load_policy
    from dlm_toolkit.evaluation.stats import compare_outcomes
    from dlm_toolkit.tasks import get_task

    check_cuda_graphs(args.cuda_graphs, [args.device])
    if args.n <= 0:
        raise ConfigError(f"--n: must be >= 1 (got {args.n})")
    if args.n_boot < 100:
        raise ConfigError(f"--n-boot: must be >= 100 (got {args.n_boot})")
    task = get_task(args.task, **task_options(args))
    check_n(task, args.n)
    if args.html is not None:  # before the model loads
        from dlm_toolkit.viewer import check_every, check_output

        check_output(args.html, args.overwrite)
        check_every(args.every, "--every")
    policies = {"a": load_policy(args.a, parse_sets(args.set_a)), "b": load_policy(args.b, parse_sets(args.set_b))}
    from dlm_toolkit.models.oracle import is_oracle_spec

    if not (is_oracle_spec(args.checkpoint) or Path(args.checkpoint).is_dir()):  # oracle:TASK: an exact model
        raise ConfigError(f"--checkpoint {args.checkpoint}: folder does not exist")
    model, tokenizer = load_for_args(args, args.checkpoint)
    results = {k: evaluate(model, tokenizer, task, p, args.n, args.seed, batch_size=args.batch_size,
                           progress=not args.no_progress, threads=args.threads, cuda_graphs=args.cuda_graphs)
               for k, p in policies.items()}
    shown = None
    if args.html is not None:
        shown = write_compare_html(args, model, tokenizer, task, policies, results["a"].records, results["b"].records)
    cmp = compare_outcomes(results["a"].records, results["b"].records, n_boot=args.n_boot, seed=args.seed)
    if args.json:
        out = {"task": task.name, "n": args.n, "seed": args.seed, "checkpoint": str(args.checkpoint),
               "a": {"source": args.a, "label": policy_label(args.a, args.set_a), "policy_hash": policies["a"].config_hash(),
                     "accuracy_interval": list(results["a"].accuracy_interval), **results["a"].metrics},
               "b": {"source": args.b, "label": policy_label(args.b, args.set_b), "policy_hash": policies["b"].config_hash(),
                     "accuracy_interval": list(results["b"].accuracy_interval), **results["b"].metrics},
               "paired": cmp.to_dict()}
        print(json.dumps(out))
        return 0
    print(f"{task.name}, {args.n} eval instances (seed {args.seed}); B minus A, 95 % intervals")
    labels = {k: policy_label(getattr(args, k), getattr(args, f"set_{k}")) for k in ("a", "b")}
    width = max(24, *(len(v) for v in labels.values()))
    for k in ("a", "b"):
        m, (lo, hi) = results[k].metrics, results[k].accuracy_interval
        print(f"  {k.upper()} {labels[k]:<{width}} accuracy {m['accuracy']:.4f} [{lo:.4f}, {hi:.4f}]  tpf {m['tpf']:.3f}")
    lo, hi = cmp.accuracy_diff_interval
    verdict = "differs" if cmp.accuracy_differs else "no significant difference"
    print(f"  accuracy  {cmp.accuracy_diff:+.4f} [{lo:+.4f}, {hi:+.4f}]  McNemar p={cmp.mcnemar_p:.4g} "
          f"({cmp.only_a} right under A only, {cmp.only_b} under B only): {verdict}")
    lo, hi = cmp.tpf_diff_interval
    verdict = "differs" if cmp.tpf_differs else "no significant difference"
    print(f"  tpf       {cmp.tpf_diff:+.3f} [{lo:+.3f}, {hi:+.3f}]  paired bootstrap: {verdict}")
    if shown is not None:
        print(f"  side by side: {args.html} ({shown})")
    return 0


SHOWN = 3  # instances on the side-by-side page


def disagreement_order(a: list[dict], b: list[dict]) -> tuple[list[int], int]:
    """Instance indices, those where A and B disagree first: scored differently (right/wrong at 0.5),
    then other completions, then the rest (each group in instance order); and how many agree
    (the same completion)."""
    def rank(i: int) -> int:
        if (float(a[i]["score"]) >= 0.5) != (float(b[i]["score"]) >= 0.5):
            return 0
        return 1 if a[i]["completion"] != b[i]["completion"] else 2

    order = sorted(range(len(a)), key=lambda i: (rank(i), i))
    return order, sum(rank(i) == 2 for i in order)


def write_compare_html(args: argparse.Namespace, model: object, tokenizer: object, task: object,
                       policies: dict, records_a: list[dict], records_b: list[dict]) -> str:
    """``--html``: up to :data:`SHOWN` eval instances, those where A and B disagree first, decoded
    again, recorded, under A and B, side by side. Returns what the page shows, in words."""
    from dlm_toolkit.models.chat import use_chat
    from dlm_toolkit.decoding.loop import decode
    from dlm_toolkit.evaluation.evaluate import task_prompt
    from dlm_toolkit.step.state import row_seed
    from dlm_toolkit.viewer import compare_page, page_title, write_page

    order, agree = disagreement_order(records_a, records_b)
    picked = order[:SHOWN]
    instances = task.instances(args.n, args.seed, "eval")  # type: ignore[attr-defined]
    chat = use_chat(tokenizer, task.chat, f"task '{task.name}': chat")  # type: ignore[attr-defined]
    prompts = [task_prompt(tokenizer, task, instances[i], chat) for i in picked]  # type: ignore[arg-type]
    seeds = [row_seed(args.seed, i) for i in picked]  # the streams the evaluation drew from
    runs = [decode(model, prompts, policies[k], task.answer_length + 1, seed=seeds, record=True,  # type: ignore
                   cuda_graphs=args.cuda_graphs) for k in ("a", "b")]
    labels = (f"A {policy_label(args.a, args.set_a)}", f"B {policy_label(args.b, args.set_b)}")
    shown = (f"rows: instances {', '.join(map(str, picked))}, where A and B disagree first; "
             f"{agree} of {len(order)} instances give the same completion under A and B")
    title = page_title(f"dlm compare {task.name}", f"{labels[0]} vs {labels[1]}", None, args.checkpoint)  # type: ignore
    title += f" ({shown})"
    page = compare_page(runs[0], runs[1], tokenizer, labels=labels, every=args.every, title=title,
                        row_labels=[f"instance {i}" for i in picked])
    write_page(args.html, page, args.overwrite)
    return shown


def policy_label(source: str, overrides: list[str] | None) -> str:
    """``"llada2.1-s + t2t.name=none"``: the preset or file and every override, so two policies that
    differ only by ``--set-a``/``--set-b`` never print the same name."""
    return " + ".join([source, *(o.strip() for o in overrides or [])])


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand."""
    from dlm_toolkit.tasks import TASKS

    p = sub.add_parser("compare", help="two policies on the same instances: paired differences with intervals",
                       description="Evaluate policies A and B on the same eval instances and report the paired "
                       "difference in accuracy (exact McNemar test, bootstrap interval) and TPF (paired bootstrap).")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder with tokenizer files")
    p.add_argument("--task", required=True, help=", ".join(sorted(TASKS)))
    p.add_argument("--a", default="llada2.1-q", help="policy A: preset name or policy file (default llada2.1-q)")
    p.add_argument("--b", default="llada2.1-s", help="policy B: preset name or policy file (default llada2.1-s)")
    p.add_argument("--set-a", action="append", metavar="KEY=VALUE", help="override in policy A, repeatable")
    p.add_argument("--set-b", action="append", metavar="KEY=VALUE", help="override in policy B, repeatable")
    p.add_argument("--n", type=int, required=True, help="number of eval instances")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--html", metavar="FILE", help="also write A and B side by side, step by step, on up to 3 "
                   "instances, those where A and B disagree first: one self-contained HTML file")
    p.add_argument("--every", type=int, default=1, metavar="K", help="with --html: one frame per K forwards")
    p.add_argument("--overwrite", action="store_true", help="with --html: replace an existing file")
    add_import_arg(p)
    add_task_args(p)
    add_runtime_args(p)
    p.set_defaults(func=cmd_compare)
    return p
