"""``dlm conformance``: the model and the decode loop against golden fixtures."""

from __future__ import annotations

import argparse


def cmd_conformance(args: argparse.Namespace) -> int:
    from dlm_toolkit.evaluation.conformance import run_conformance

    modes = {"both": (True, False), "on": (True,), "off": (False,)}[args.kv]
    passed = failed = decodes = values = traced = 0
    for check in run_conformance(args.folder, modes, device=args.device):
        decodes += check.decode
        values += check.values
        traced += check.traced
        if check.passed:
            passed += 1
            if args.verbose:
                print(f"ok   {check.name}" + (f" ({check.values} values, {check.traced} traced forwards)" * check.decode))
        else:
            failed += 1
            for f in check.failures:
                print(f"FAIL {check.name}: {f}")
    print(f"{passed + failed - decodes} logits checks, {decodes} decodes ({decodes // len(modes)} cases x "
          f"{len(modes)} KV modes): {values} expected values and {traced} traced forwards compared")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``conformance`` subcommand."""
    p = sub.add_parser("conformance", help="check model + decoding against golden fixtures",
                       description="Run every case of a conformance fixture folder.")
    p.add_argument("folder")
    p.add_argument("--kv", choices=["both", "on", "off"], default="both", help="KV-cache modes to run")
    p.add_argument("-v", "--verbose", action="store_true", help="also print passing checks")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (always float32: the goldens' precision)")
    p.set_defaults(func=cmd_conformance)
