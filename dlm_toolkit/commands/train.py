"""``dlm train CONFIG.yaml --out DIR [--resume | --overwrite] [--tracking-uri URI] [--set key=value ...] [--device D --dtype T --threads N]``.

Wire into the main parser with ``register(subparsers)``; bad configs raise
:class:`~dlm_toolkit.config.ConfigError` (the CLI exits 2 with the message).
"""

from __future__ import annotations

import argparse
import json

from dlm_toolkit.commands.common import parse_sets


def cmd_train(args: argparse.Namespace) -> int:
    from dlm_toolkit.util.runtime import resolve_threads
    from dlm_toolkit.training.loop import load_train_config, train

    overrides = parse_sets(args.set)
    if args.threads is not None:
        overrides["threads"] = resolve_threads(args.threads, small_model=True)
    overrides |= {k: getattr(args, k) for k in ("device", "dtype") if getattr(args, k) is not None}
    config = load_train_config(args.config, overrides)
    out = train(config, args.out, tracking_uri=args.tracking_uri, progress=not args.no_progress,
                resume=args.resume, overwrite=args.overwrite)
    info = json.loads((out / "training.json").read_text())
    print(f"saved {out}  steps {info['steps']}  wall {info['wall_time_s']:.0f} s  "
          f"final loss {info['final_loss_smoothed']:.4f}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to ``subparsers`` (from ``parser.add_subparsers``)."""
    p = subparsers.add_parser(
        "train", help="train a tiny editable block-diffusion model",
        description="Train an LLaDA2 MoE model with the editable-dLLM objective (see dlm_toolkit.training).")
    p.add_argument("config", help="training config (.yaml or .json), e.g. experiments/train/editable.yaml")
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI, e.g. sqlite:///mlflow.db")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field (flat key, e.g. steps=100 or tasks.add=0.5); repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out from its last resume point (same config)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the checkpoint (or other files train writes) already in --out; without it such "
                        "a folder is refused")
    g = p.add_argument_group("where and how to run (override the config's device, dtype, threads)")
    g.add_argument("--device", help="cpu (default), cuda or cuda:N")
    g.add_argument("--dtype", help="compute dtype: float32 (default) or bfloat16 (autocast; weights stay float32)")
    g.add_argument("--threads", type=int, help="intra-op CPU threads (default: the config's, 1)")
    p.set_defaults(func=cmd_train)
    return p
