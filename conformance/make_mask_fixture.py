"""Write ``conformance/llada2_mask``: golden cases where the mask token's share of the softmax
decides, made with the reference transcription (``reference.py``), not with our engine.

The model is a tiny random LLaDA2 whose ``<|mask|>`` row of ``lm_head`` is a row like any other (the
official tiny fixture nearly zeroes it). On it the reference meets three situations, and the
fixture keeps cases of each:

- ``exact``: the reference finishes; every output, count and traced forward must match.
- ``mask_decides``: as ``exact``, and a softmax without the mask token would have decided at least
  one commit, edit or fallback differently (the case proves the mask stays in the softmax).
- ``mask_drawn``: the reference draws the mask token at a position it writes and would loop
  forever; the only expectation is ``no_mask_in_output`` (the engine writes a real token there).

Run from the repository root: ``python conformance/make_mask_fixture.py``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from conformance.reference import MaskDrawn, reference_decode  # noqa: E402
from dlm_toolkit.models import save_model  # noqa: E402
from dlm_toolkit.testing.models import tiny_llada2  # noqa: E402

OUT = ROOT / "conformance" / "llada2_mask"
MODEL_SEED = 0
MODES = {"q": (0.7, 0.5, 16), "s": (0.5, 0.0, 16), "2.0": (0.95, None, 0)}
WANT = {"exact": 4, "mask_decides": 3, "mask_drawn": 3}


def main() -> None:
    torch.set_num_threads(1)
    model = tiny_llada2(MODEL_SEED, keep_mask_row=True)
    mask_id, eos_id = model.mask_token_id, model.eos_token_id
    fn = lambda ids, pos, attn: model.forward_window(ids, pos, attn)  # noqa: E731
    cases, found = [], {k: 0 for k in WANT}
    rng = random.Random(0)
    for i in range(400):
        if found == WANT:
            break
        mode = ("q", "s", "2.0")[i % 3]
        threshold, editing, post = MODES[mode]
        block = rng.choice([4, 8])
        case = {
            "prompt_ids": [rng.randrange(0, eos_id) for _ in range(rng.randrange(3, 14))],
            "gen_length": rng.choice([16, 24, 32]),
            "block_length": block,
            "threshold": threshold,
            "editing": "on" if editing is not None else "off",
            "editing_threshold": editing if editing is not None else 2.0,
            "max_post_steps": post,
            "eos_early_stop": rng.random() < 0.5,
            "temperature": 0.0,
        }
        kw = {k: case[k] for k in ("block_length", "threshold", "editing_threshold", "max_post_steps", "eos_early_stop")}
        args = (fn, case["prompt_ids"], case["gen_length"])
        try:
            ref = reference_decode(*args, **kw, mask_id=mask_id, eos_id=eos_id)
        except MaskDrawn:
            kind, ref = "mask_drawn", None
        else:
            try:
                without = reference_decode(*args, **kw, mask_id=mask_id, eos_id=eos_id, mask_in_softmax=False)["trace"]
            except MaskDrawn:
                without = None
            kind = "mask_decides" if without is not None and without != ref["trace"] else "exact"
        if found[kind] == WANT[kind]:
            continue
        found[kind] += 1
        case["name"] = f"{kind}_{found[kind]}_{mode}_b{block}"
        case["exercises"] = [kind]
        if ref is None:
            case["expected"] = {"no_mask_in_output": True}
        else:
            case["expected"] = {"output_ids": ref["output_ids"], "nfe": ref["nfe"], "no_mask_in_output": True}
            case["trace"] = ref["trace"]
        cases.append(case)
    if found != WANT:
        raise SystemExit(f"found only {found} of {WANT}: try another MODEL_SEED")
    OUT.mkdir(exist_ok=True)
    save_model(model, OUT)
    spec = {
        "format_version": 1,
        "description": "mask token inside the softmax: reference decisions and degenerate cases; see README.md",
        "checkpoint": {"config": "config.json", "weights": "model.safetensors"},
        "mask_id": mask_id,
        "eos_id": eos_id,
        "temperature": 0.0,
        "num_to_transfer": 1,
        "editing_off_value": 2.0,
        "cases": cases,
    }
    (OUT / "cases.json").write_text(json.dumps(spec, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}: {found}")


if __name__ == "__main__":
    main()
