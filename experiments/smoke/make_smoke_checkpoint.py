"""Write ``checkpoints/smoke-long``: a tiny LLaDA2 MoE with random weights and an 8,192-position context.

    python experiments/smoke/make_smoke_checkpoint.py checkpoints/smoke-long

The trained testbeds have a 256-position context, too short for the code benchmarks' prompts; this
model's only purpose is to let every benchmark pipeline (prompts, decoding, the sandbox, the verdicts,
the report) run end to end on a CPU in seconds, before a real checkpoint is downloaded. It has never
been trained: its scores are ~0 by design. Same architecture and checkpoint format as the real models
(``model_type: llada2_moe``, safetensors, the character tokenizer of the testbeds). Deterministic: the
same command writes the same weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dlm_toolkit.models.checkpoint import save_model
from dlm_toolkit.models.tokenizer import build_char_tokenizer, save_tokenizer
from dlm_toolkit.testing.models import tiny_llada2
from dlm_toolkit.util.files import atomic_write_many

CONTEXT = 8192
CARD = """# smoke-long

A tiny LLaDA2 MoE diffusion LM with **random, untrained weights** (hidden 32, 2 layers, 8 experts top-2, 1 shared
expert, first layer dense, the testbeds' 128-id character tokenizer) and a context of {context} positions, in the
official LLaDA2 checkpoint format. Written by `python experiments/smoke/make_smoke_checkpoint.py
checkpoints/smoke-long` (seeded: the same weights every time).

**What it is for:** seeing a benchmark pipeline run end to end on a CPU before downloading a real checkpoint:
the official prompts (code benchmarks' prompts are thousands of characters, past the testbeds' 256-position
context), decoding, the bubblewrap sandbox, the verdicts and the report. Its scores are ~0 by design: it has never
been trained. README "Reproduce the paper" gives one smoke line per benchmark, run by `tests/test_smoke_benchmarks.py`.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest")
    dest = Path(ap.parse_args().dest)
    model = tiny_llada2(seed=0, vocab_size=128, mask_token_id=1, eos_token_id=0, max_position_embeddings=CONTEXT)
    save_model(model, dest)
    save_tokenizer(build_char_tokenizer(), dest)
    atomic_write_many(dest, {"README.md": lambda tmp: tmp.write_text(CARD.format(context=CONTEXT))})
    print(f"wrote {dest}: {sum(f.stat().st_size for f in dest.iterdir()) / 2**10:.0f} KiB")


if __name__ == "__main__":
    main()
