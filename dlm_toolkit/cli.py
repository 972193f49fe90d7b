"""The ``dlm`` command. Each subcommand is a thin shell over a library function, in its own module
of :mod:`dlm_toolkit.commands` (which import :mod:`dlm_toolkit.commands.common`, never this one).

Every command that takes a policy takes it the same way: ``--preset NAME`` or ``--policy FILE``,
then ``--set KEY=VALUE`` flat-key overrides (``--set t2t.name=none`` switches the rule and
resets its params before any ``t2t.params.*`` given alongside).
Bad input exits with code 2 and one message, no traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from typing import Sequence

from dlm_toolkit.config import ConfigError
from dlm_toolkit.decoding.policy import StrategyError

# subcommand modules in the order `dlm --help` lists them
COMMANDS = ("decode", "conformance", "strategies", "sweep", "eval", "train", "compare")


LM_EVAL_NOTE = ("lm-evaluation-harness: run `dlm-lm-eval --model dlm --model_args checkpoint=DIR ...` (pip install "
                "-e \".[eval]\"), not `lm_eval --model dlm`: lm-eval 0.4.13 finds models only among its own modules, "
                "so `dlm-lm-eval` is lm-eval's own command line with the dlm model registered first.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlm", description="Decoding strategies for diffusion language models.",
                                     epilog=LM_EVAL_NOTE)
    sub = parser.add_subparsers(dest="command", required=True)

    for command in COMMANDS:
        import_module(f"dlm_toolkit.commands.{command}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dlm_toolkit.strategy.registry import set_allow_imports

    args = build_parser().parse_args(argv)
    set_allow_imports(getattr(args, "allow_import", False))
    try:
        return args.func(args)
    except (ConfigError, StrategyError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
