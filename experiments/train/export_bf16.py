"""Copy a trained checkpoint with its weights stored in bfloat16 (router weights stay float32).

    python experiments/train/export_bf16.py runs/editable-v2 checkpoints/testbed-v2-editable

Halves the file size; the shipped v2 testbeds are made this way (their cards are measured on the
bfloat16 files, which load in float32 on the CPU by default). Tokenizer files, ``training.json``
and ``loss_curve.png`` are copied as they are. Every file is written under a temporary name and
renamed into place (dlm_toolkit.util.files), so a kill or a full disk leaves ``dest`` as it was.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from dlm_toolkit.util.files import atomic_write_many
from dlm_toolkit.models.checkpoint import load_model, save_model
from dlm_toolkit.models.llada2 import LLaDA2MoeModelLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("dest")
    args = ap.parse_args()
    src, dest = Path(args.source), Path(args.dest)
    model = load_model(src)
    stored = LLaDA2MoeModelLM(model.config, dtype=torch.bfloat16)  # the router stays float32
    stored.load_state_dict(model.state_dict())
    save_model(stored, dest)
    copies = [name for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                "training.json", "loss_curve.png") if (src / name).is_file()]
    atomic_write_many(dest, {name: (lambda tmp, name=name: shutil.copyfile(src / name, tmp)) for name in copies})
    print(f"wrote {dest}: {sum(f.stat().st_size for f in dest.iterdir()) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
