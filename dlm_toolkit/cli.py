"""The ``dlm`` command. Each subcommand is a thin shell over a library function.

Every command that takes a policy takes it the same way: ``--preset NAME`` or ``--policy FILE``,
then ``--set KEY=VALUE`` flat-key overrides (``--set t2t.name=none`` switches the rule and
resets its params before any ``t2t.params.*`` given alongside).
Bad input exits with code 2 and one message, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from dlm_toolkit.config import ConfigError, PolicyConfig, load_policy, parse_value
from dlm_toolkit.policy import StrategyError

def parse_sets(items: Sequence[str] | None) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` → ``{"a.b": 1, "c": "x"}`` (values parsed as JSON where possible)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. m2t.params.threshold=0.8")
        out[key.strip()] = parse_value(value.strip())
    return out


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", help="named policy (see `dlm strategies presets`); default llada2.1-q")
    g.add_argument("--policy", help="policy file (.json or .yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="flat-key override, repeatable")
    add_import_arg(p)


def add_import_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-import", action="store_true",
                   help="let policies name strategy classes as package.module:Class (imports that module)")


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    return load_policy(args.policy or args.preset, parse_sets(args.set))


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype``, ``--threads``: the same three options on every command that runs a model."""
    g = p.add_argument_group("where and how to run")
    g.add_argument("--device", help="cpu (default), cuda or cuda:N")
    g.add_argument("--dtype", help="weight dtype: float32 (CPU default), bfloat16 (GPU default) or float16")
    g.add_argument("--threads", type=int, help="intra-op CPU threads (default: 1 for small models, torch's default otherwise)")


def load_for_args(args: argparse.Namespace, path: str, need_tokenizer: bool = True, **ids: int | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of checkpoint ``path`` on ``--device`` in ``--dtype``, with ``--threads``
    applied; ``ids``: ``mask_token_id``/``eos_token_id`` overrides. Under ``torchrun`` each rank
    loads its shard of the model and only rank 0 prints (see :mod:`dlm_toolkit.distributed`)."""
    from dlm_toolkit.distributed import init_from_env
    from dlm_toolkit.evaluate import load_checkpoint
    from dlm_toolkit.runtime import apply_threads, is_small, resolve_dtype, resolve_threads

    resolve_threads(args.threads, small_model=True)  # a bad value fails before the model loads
    tp, device = init_from_env(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer = load_checkpoint(path, need_tokenizer, device=device, dtype=dtype, tp=tp, **ids)
    apply_threads(resolve_threads(args.threads, small_model=is_small(model)))
    return model, tokenizer


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None


# -- decode ---------------------------------------------------------------------------------
def cmd_decode(args: argparse.Namespace) -> int:
    from dlm_toolkit.decode import decode

    policy = policy_from_args(args)
    model, tokenizer = load_for_args(args, args.checkpoint, need_tokenizer=False,
                                     mask_token_id=args.mask_id, eos_token_id=args.eos_id)
    if args.prompt_ids is not None:
        prompt = parse_ids(args.prompt_ids)
    else:
        if tokenizer is None:
            raise ConfigError(f"{args.checkpoint} has no tokenizer files: use --prompt-ids instead of --prompt")
        prompt = tokenizer.encode(args.prompt, add_special_tokens=False)
    result = decode(model, [prompt], policy, args.gen_length, kv_cache=not args.no_kv_cache, seed=args.seed,
                    allow_past_context=args.allow_past_context)
    row = result.rows[0]
    text = tokenizer.decode(row.tokens, skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        out = {**result.row_dict(0), "text": text, "wall_time_s": result.wall_time,
               "tokens_per_second": result.tokens_per_second, "policy": policy.model_dump(mode="json"),
               "policy_hash": policy.config_hash()}
        print(json.dumps(out))
    else:
        print("tokens:", " ".join(map(str, row.tokens)))
        if text is not None:
            print("text:  ", text)
        print(f"nfe {row.nfe}  tpf {row.tpf:.2f} (tokens up to and including the first EOS per forward)  "
              f"edits {row.edits}  {result.tokens_per_second:.1f} tokens/s")
    return 0


# -- conformance ----------------------------------------------------------------------------
def cmd_conformance(args: argparse.Namespace) -> int:
    from dlm_toolkit.conformance import run_conformance

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


# -- strategies -----------------------------------------------------------------------------
def cmd_strategies(args: argparse.Namespace) -> int:
    from dlm_toolkit.catalogue import describe_strategies
    from dlm_toolkit.presets import list_presets

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
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("decode", help="decode one prompt with a policy", description="Decode one prompt.")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json + safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompt", help="prompt text (needs tokenizer files in the checkpoint)")
    p.add_argument("--gen-length", type=int, required=True)
    add_policy_args(p)
    p.add_argument("--mask-id", type=int, help="mask token id (default: from config.json or the tokenizer)")
    p.add_argument("--eos-id", type=int, help="EOS token id (default: from config.json or the tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the prefix every forward")
    p.add_argument("--allow-past-context", action="store_true",
                   help="decode even past the model's max_position_embeddings (positions it never saw)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_runtime_args(p)
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("conformance", help="check model + decoding against golden fixtures",
                       description="Run every case of a conformance fixture folder.")
    p.add_argument("folder")
    p.add_argument("--kv", choices=["both", "on", "off"], default="both", help="KV-cache modes to run")
    p.add_argument("-v", "--verbose", action="store_true", help="also print passing checks")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N (always float32: the goldens' precision)")
    p.set_defaults(func=cmd_conformance)

    p = sub.add_parser("strategies", help="list registered strategies or presets",
                       description="List strategies by role (with source and config fields) or presets.")
    p.add_argument("what", choices=["list", "presets"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_strategies)

    from dlm_toolkit.compare import register as register_compare
    from dlm_toolkit.sweep.cli import register as register_sweep
    from dlm_toolkit.training_cli import register as register_train

    register_sweep(sub)
    register_train(sub)
    register_compare(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dlm_toolkit.registry import set_allow_imports

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
