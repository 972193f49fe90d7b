"""lm-eval through the ``dlm`` model at full size: random weights in LLaDA2.1-mini's shapes, a
157184-id tokenizer with the LLaDA2.1 chat structure (the test fixture's template, the real mask/EOS
ids), lm-eval's GSM8K task over a local test.jsonl, ``--apply_chat_template``, batch 8.

One GPU::

    python benchmarks/lm_eval_mini.py --shape mini --device cuda --n 16 --batch 8 --json

CPU (the scaled-down shape, what the tests' tools can run)::

    python benchmarks/lm_eval_mini.py --shape smoke --device cpu --n 4 --batch 4 --gen 64

Prints lm-eval's accuracy (meaningless on random weights: this shows the path holds at size) and the
dlm model's totals from the results (``config.dlm``): NFE, TPF, tokens/s, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import full_scale  # noqa: E402  (random_model, the official shapes)

from dlm_toolkit.integrations.lm_eval import write_gsm8k_task  # noqa: E402
from dlm_toolkit.models import TensorParallel, save_model  # noqa: E402

FIXTURE_TOKENIZER = REPO / "tests" / "fixtures" / "llada2.1-chat-tokenizer"
FIXTURE_GSM8K = REPO / "tests" / "fixtures" / "benchmarks" / "gsm8k" / "test.jsonl"


def write_tokenizer(folder: Path, vocab_size: int, mask_id: int, eos_id: int) -> None:
    """Characters at the low ids, the chat control tokens below EOS, EOS and mask at the config's ids,
    the rest unused: every id the model can write decodes to something."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(0x20, 0x7F)]
    vocab = {t: i for i, t in enumerate(["<|unk|>", *chars])}
    controls = {"<role>": eos_id - 3, "</role>": eos_id - 2, "<|role_end|>": eos_id - 1,
                "<|endoftext|>": eos_id, "<|mask|>": mask_id}
    taken = set(vocab.values()) | set(controls.values())
    vocab.update(controls)
    vocab.update({f"<|unused_{i}|>": i for i in range(vocab_size) if i not in taken})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(controls))
    template = json.loads((FIXTURE_TOKENIZER / "tokenizer_config.json").read_text())["chat_template"]
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  mask_token="<|mask|>", unk_token="<|unk|>", clean_up_tokenization_spaces=False)
    tok.chat_template = template
    tok.save_pretrained(str(folder))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="mini", choices=("mini", "smoke"))
    p.add_argument("--layers", type=int, help="build only the first N layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, default=16, help="GSM8K problems (lm-eval --limit)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--gen", type=int, default=256, help="max_gen_toks")
    p.add_argument("--preset", default="llada2.1-q")
    p.add_argument("--data", default=str(FIXTURE_GSM8K), help="a GSM8K test.jsonl (default: the test fixture)")
    p.add_argument("--out", help="working folder (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="lm_eval_mini_"))
    ckpt = work / "checkpoint"
    cfg = full_scale.config(args.shape, args.layers)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = full_scale.random_model(cfg, dtype, device, TensorParallel(), logit_scale=8.0 if args.shape == "mini" else 30.0)
    save_model(model, ckpt)
    del model
    write_tokenizer(ckpt, cfg.vocab_size, cfg.mask_token_id, cfg.eos_token_id)
    task = write_gsm8k_task(work / "tasks", args.data, max_gen_toks=args.gen)
    dtype_arg = "bfloat16" if device.type == "cuda" else "float32"
    cmd = [sys.executable, "-m", "dlm_toolkit.integrations.lm_eval", "--model", "dlm", "--model_args",
           f"checkpoint={ckpt},preset={args.preset},device={args.device},dtype={dtype_arg}",
           "--tasks", task, "--include_path", str(work / "tasks"), "--batch_size", str(args.batch),
           "--limit", str(args.n), "--apply_chat_template", "--output_path", str(work / "results")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    result = json.loads(sorted((work / "results").rglob("results_*.json"))[-1].read_text())
    dlm = result["config"]["dlm"]
    row = {"shape": args.shape, "layers": cfg.num_hidden_layers, "device": args.device, "n": args.n,
           "batch": args.batch, "max_gen_toks": args.gen, "preset": args.preset,
           "flexible": result["results"][task]["exact_match,flexible-extract"],
           **{k: dlm[k] for k in ("nfe_mean", "tpf", "tokens_per_second", "wall_time_s", "stopped_at_eos",
                                   "stopped_at_stop_string", "blocks_skipped")}}
    print(json.dumps(row) if args.json else "\n".join(f"{k:24} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
