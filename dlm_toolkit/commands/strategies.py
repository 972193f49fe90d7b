"""``dlm strategies``: the registered strategies by role, or the presets."""

from __future__ import annotations

import argparse
import json


def cmd_strategies(args: argparse.Namespace) -> int:
    from dlm_toolkit.strategy.catalogue import describe_strategies
    from dlm_toolkit.strategy.presets import list_presets

    if args.what == "presets":
        print(json.dumps(list_presets()) if args.json else "\n".join(list_presets()))
        return 0
    info = describe_strategies()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for role, entries in info["roles"].items():
        print(f"{role}:")
        for e in entries:
            print(f"  {e['name']:<18} [{e['source']}] {e['summary']}")
            for f in e["fields"]:
                rng = f"  ({f['range']})" if f["range"] else ""
                print(f"      {f['name']}: {f['type']} = {f['default']!r}{rng}")
    for name, err in info["failed_plugins"].items():
        print(f"plug-in {name} FAILED to load: {err}")
    from dlm_toolkit.strategy.registry import REGISTRIES

    for registry in REGISTRIES.values():
        for message in registry.clashes().values():
            print(f"name clash: {message}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``strategies`` subcommand."""
    p = sub.add_parser("strategies", help="list registered strategies or presets",
                       description="List strategies by role (with source and config fields) or presets.")
    p.add_argument("what", choices=["list", "presets"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_strategies)
