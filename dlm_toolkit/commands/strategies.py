"""``dlm strategies``: the registered strategies by role and the step hooks they ask for, or the presets."""

from __future__ import annotations

import argparse
import json
from typing import Any


def preset_line(policy: dict[str, Any]) -> str:
    """One line of a policy's settings: each role's rule with the parameters the preset sets, then sampling."""
    parts = []
    for role in ("m2t", "t2t", "blocks", "remask"):
        spec = policy[role]
        params = ", ".join(f"{k}={json.dumps(v)}" for k, v in spec.get("params", {}).items())
        parts.append(f"{role} {spec['name']}" + (f"({params})" if params else ""))
    sampling = policy.get("sampling") or {}
    parts.append(", ".join(f"{k} {json.dumps(v)}" for k, v in sampling.items()) or "temperature 0.0")
    return " | ".join(parts)


def describe_presets() -> dict[str, dict[str, Any]]:
    """Each preset's policy as its file writes it (the keys it sets; the rest are the rules' defaults)."""
    from dlm_toolkit.config import read_mapping_file
    from dlm_toolkit.strategy.presets import list_presets, presets_dir

    return {name: read_mapping_file(presets_dir() / f"{name}.json") for name in list_presets()}


def describe_hooks() -> list[dict[str, str]]:
    """The step hooks the registered rules ask for: each rule put in its role of the default preset,
    and the policy built (no model) to collect its hooks. A rule that cannot be built that way is
    listed with what it asks for left open."""
    from dlm_toolkit.decoding.policy import DecodingPolicy
    from dlm_toolkit.strategy.policy_config import load_policy
    from dlm_toolkit.strategy.presets import DEFAULT_PRESET
    from dlm_toolkit.strategy.registry import REGISTRIES

    base = load_policy(DEFAULT_PRESET).model_dump()
    found = []
    for role, registry in REGISTRIES.items():
        for entry in registry.entries():
            if not callable(getattr(entry.cls, "step_hooks", None)):
                continue
            try:
                hooks = DecodingPolicy({**base, role: {"name": entry.name}}).hooks
            except Exception as err:  # a rule that needs other rules beside it (wino_shadow needs m2t wino)
                found.append({"hook": "(depends on the policy: " + str(err).splitlines()[0][:120] + ")",
                              "role": role, "rule": entry.name, "source": entry.source, "summary": ""})
                continue
            for hook in hooks:
                cls = type(hook)
                doc = " ".join((cls.__doc__ or "").split()).split(": ")[0].split(". ")[0]  # its first clause
                found.append({"hook": f"{cls.__module__}:{cls.__qualname__}", "role": role, "rule": entry.name,
                              "source": entry.source, "summary": doc})
    return found


def cmd_strategies(args: argparse.Namespace) -> int:
    from dlm_toolkit.strategy.catalogue import describe_strategies
    from dlm_toolkit.strategy.registry import REGISTRIES

    if args.what == "presets":
        presets = describe_presets()
        if args.json:
            print(json.dumps(presets, indent=1))
        else:
            width = max(map(len, presets), default=0)
            for name, policy in presets.items():
                print(f"{name:<{width}}  {preset_line(policy)}")
        return 0
    info = describe_strategies()
    info["hooks"] = describe_hooks()
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
    print("step hooks (each asked for by a rule; README \"Write a strategy\"):")
    for h in info["hooks"]:
        print(f"  {h['hook']}  <- {h['role']} {h['rule']} [{h['source']}]" + (f"  {h['summary']}" if h["summary"] else ""))
    for name, err in info["failed_plugins"].items():
        print(f"plug-in {name} FAILED to load: {err}")
    for registry in REGISTRIES.values():
        for message in registry.clashes().values():
            print(f"name clash: {message}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``strategies`` subcommand."""
    p = sub.add_parser("strategies", help="list registered strategies and step hooks, or presets",
                       description="list: strategies by role (source and config fields) and the step hooks "
                       "their rules ask for; presets: each preset with its settings.")
    p.add_argument("what", choices=["list", "presets"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_strategies)
