"""``dlm decode``: one prompt, one policy."""

from __future__ import annotations

import argparse
import json

from dlm_toolkit.commands.common import add_policy_args, add_runtime_args, load_for_args, parse_ids, policy_from_args
from dlm_toolkit.commands.common import check_cuda_graphs, prompt_text
from dlm_toolkit.config import ConfigError


def cmd_decode(args: argparse.Namespace) -> int:
    from dlm_toolkit.decoding.loop import decode

    check_cuda_graphs(args.cuda_graphs, [args.device])
    policy = policy_from_args(args)
    if args.html is not None:  # before the model loads
        from dlm_toolkit.viewer import check_every, check_output

        check_output(args.html, args.overwrite)
        check_every(args.every, "--every")
    if args.prompt is not None:
        prompt_text(args.prompt)  # before the model loads
    if args.system is not None:
        prompt_text(args.system, "--system")
    if (args.chat or args.system is not None) and args.prompt is None:
        raise ConfigError("--chat/--system format a --prompt text; they do not apply to --prompt-ids")
    if args.system is not None and not args.chat:
        raise ConfigError("--system: needs --chat (a system turn exists only in the chat template)")
    model, tokenizer = load_for_args(args, args.checkpoint, need_tokenizer=False,
                                     mask_token_id=args.mask_id, eos_token_id=args.eos_id)
    if args.prompt_ids is not None:
        prompt = parse_ids(args.prompt_ids)
    else:
        if tokenizer is None:
            raise ConfigError(f"{args.checkpoint} has no tokenizer files: use --prompt-ids instead of --prompt")
        from dlm_toolkit.models.chat import encode_prompt, use_chat

        chat = use_chat(tokenizer, "true" if args.chat else "false", "--chat")
        prompt = encode_prompt(tokenizer, args.prompt, chat, args.system)
    result = decode(model, [prompt], policy, args.gen_length, kv_cache=not args.no_kv_cache, seed=args.seed,
                    allow_past_context=args.allow_past_context, cuda_graphs=args.cuda_graphs,
                    record=args.html is not None)
    if args.html is not None:
        from dlm_toolkit.commands.compare import policy_label
        from dlm_toolkit.strategy.presets import DEFAULT_PRESET
        from dlm_toolkit.viewer import page_title, trajectory_page, write_page

        prompt_start = args.prompt if args.prompt is not None else args.prompt_ids
        title = page_title("dlm decode", policy_label(args.policy or args.preset or DEFAULT_PRESET, args.set),
                           prompt_start, args.checkpoint)
        write_page(args.html, trajectory_page(result, tokenizer, every=args.every, title=title), args.overwrite)
    row = result.rows[0]
    text = tokenizer.decode(row.tokens, skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        out = {**result.row_dict(0), "text": text, "wall_time_s": result.wall_time,
               "tokens_per_second": result.tokens_per_second, "policy": policy.model_dump(mode="json"),
               "policy_hash": policy.config_hash(), **({"html": args.html} if args.html is not None else {})}
        print(json.dumps(out))
    else:
        print("tokens:", " ".join(map(str, row.tokens)))
        if text is not None:
            print("text:  ", text)
        print(f"nfe {row.nfe}  tpf {row.tpf:.2f} (tokens up to and including the first EOS per forward)  "
              f"edits {row.edits}  {result.tokens_per_second:.1f} tokens/s")
        if args.html is not None:
            print(f"viewer: {args.html}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``decode`` subcommand."""
    p = sub.add_parser("decode", help="decode one prompt with a policy", description="Decode one prompt.")
    p.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json + safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    src.add_argument("--prompt", help="prompt text (needs tokenizer files in the checkpoint)")
    p.add_argument("--gen-length", type=int, required=True)
    p.add_argument("--chat", action="store_true",
                   help="format --prompt as a user turn with the checkpoint's chat template (as transformers' "
                        "apply_chat_template(..., add_generation_prompt=True))")
    p.add_argument("--system", help="with --chat: a system turn before the prompt")
    add_policy_args(p)
    p.add_argument("--mask-id", type=int, help="mask token id (default: from config.json or the tokenizer)")
    p.add_argument("--eos-id", type=int, help="EOS token id (default: from config.json or the tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the prefix every forward")
    p.add_argument("--allow-past-context", action="store_true",
                   help="decode even past the model's max_position_embeddings (positions it never saw)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--html", metavar="FILE", help="also write the step-by-step viewer of this decode (one "
                   "self-contained HTML file; the decode is recorded)")
    p.add_argument("--every", type=int, default=1, metavar="K", help="with --html: one frame per K forwards")
    p.add_argument("--overwrite", action="store_true", help="with --html: replace an existing file")
    add_runtime_args(p)
    p.set_defaults(func=cmd_decode)
