"""Run a conformance fixture folder (format of ``conformance/llada2_tiny``) against our
model and decode loop: a logits check plus every decode case, with the KV cache on and off.

Every value a case's ``expected`` block holds is compared, and so is its per-forward ``trace``
(commits, edits, masked counts, the block after each forward). A key the runner does not know is
a failure, never a skip: a fixture that pins down something we do not check must say so loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file

from dlm_toolkit.config import ConfigError
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.models.base import model_device
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.step.state import DecodeResult

LOGITS_TOLERANCE = 1e-4


@dataclass
class Check:
    """One logits comparison or one decode case (in one KV mode): its failures, how many expected
    values it compared and how many traced forwards (each compared field by field)."""

    name: str
    failures: list[str]
    values: int = 0
    traced: int = 0
    decode: bool = False

    @property
    def passed(self) -> bool:
        return not self.failures


def case_policy(case: dict[str, Any]) -> DecodingPolicy:
    """The policy a reference ``generate()`` call of this case amounts to."""
    editing = case.get("editing", "on") == "on" and case["editing_threshold"] < 1.0
    return DecodingPolicy(
        {
            "m2t": {"name": "threshold", "params": {"threshold": case["threshold"]}},
            "t2t": {"name": "threshold", "params": {"threshold": case["editing_threshold"]}}
            if editing
            else {"name": "none"},
            "blocks": {
                "name": "semi_ar",
                "params": {
                    "block_length": case["block_length"],
                    "max_post_steps": case["max_post_steps"],
                    "eos_early_stop": case["eos_early_stop"],
                },
            },
            "sampling": {"temperature": case.get("temperature", 0.0)},
        }
    )


def observed(case: dict[str, Any], result: DecodeResult, mask_id: int) -> dict[str, Any]:
    """The quantities a case's ``expected`` block lists, measured on our decode of it.

    ``no_mask_in_output`` is for degenerate cases (the mask token is the argmax somewhere), where
    the reference never finishes and so has no outputs to compare: we only promise a clean output.
    """
    row, steps = result.rows[0], result.trajectory.steps
    threshold = case["threshold"]
    trace = []
    for s in steps:
        fallback = s.masks_before > 0 and len(s.commit) == 1 and s.confidence[s.positions.index(s.commit[0])] <= threshold
        trace.append(
            {
                "block": s.block,
                "masks_before": s.masks_before,
                "post": s.post,
                "fallback": fallback,
                "m2t": s.commit,
                "t2t": s.edit,
                "block_after": s.block_after,
            }
        )
    last_hi = (max(s.block for s in steps) + 1) * case["block_length"] if steps else 0
    return {
        "output_ids": row.tokens,
        "nfe": row.nfe,
        "m2t_commits": row.commits,
        "t2t_edits": row.edits,
        "fallback_steps": sum(t["fallback"] for t in trace),
        "multi_commit_steps": row.multi_commit_steps,
        "post_forwards": row.post_forwards,
        "post_forwards_with_edit": row.post_forwards_with_edit,
        "blocks_decoded": row.blocks_decoded,
        "eos_early_stopped": row.eos_stopped,
        "final_canvas": result.canvas[0, :last_hi].tolist(),
        "no_mask_in_output": mask_id not in row.tokens,
        "trace": trace,
    }


def compare(case: dict[str, Any], got: dict[str, Any]) -> tuple[list[str], int, int]:
    """``(failures, expected values compared, traced forwards compared)`` for a case."""
    problems = []
    for key, want in case["expected"].items():
        if key not in got:
            problems.append(f"expected.{key}: not a quantity this runner knows how to check")
        elif got[key] != want:
            problems.append(f"{key}: expected {want}, got {got[key]}")
    traced = case.get("trace", [])
    if traced:
        problems += compare_trace(traced, got["trace"])
    return problems, len(case["expected"]), len(traced)


def compare_trace(want: list[dict], got: list[dict]) -> list[str]:
    """The first differing forward of a per-forward trace (every key of every entry compared)."""
    for i, (w, g) in enumerate(zip(want, got)):
        unknown = [k for k in w if k not in g]
        if unknown:
            return [f"trace[{i}]: keys {unknown} are not quantities this runner knows how to check"]
        diff = [k for k in w if w[k] != g[k]]
        if diff:
            return [f"trace[{i}] first differs in {', '.join(diff)}: expected {w}, got { {k: g[k] for k in w} }"]
    if len(want) != len(got):
        return [f"trace: expected {len(want)} forwards, got {len(got)}"]
    return []


def run_conformance(folder: str | Path, kv_modes: tuple[bool, ...] = (True, False),
                    device: str | torch.device = "cpu") -> Iterator[Check]:
    """Yield one :class:`Check` for the logits fixture and one per (case, KV mode).

    The model runs in float32 on ``device``: the goldens are float32, and on a GPU (where float32
    matmuls do not use TF32 unless asked) the same tolerances hold, so a GPU run checks the CUDA
    path of the model and the decode loop against the reference.
    """
    from dlm_toolkit.models import load_model
    from dlm_toolkit.util.runtime import resolve_device

    folder = Path(folder)
    from dlm_toolkit.models.validate import CheckpointError, read_json_object

    try:  # a regular file of bounded size and depth, holding an object
        spec = read_json_object(folder / "cases.json", "index")
    except CheckpointError as err:
        raise ConfigError(f"{folder}: cannot read cases.json: {err}") from None
    model = load_model(folder, device=resolve_device(device), mask_token_id=spec["mask_id"],
                       eos_token_id=spec["eos_id"], check_finite=True)
    if "logits_fixture" in spec:
        yield from check_logits(model, folder, spec["logits_fixture"])
    for case in spec["cases"]:
        for kv in kv_modes:
            name = f"{case['name']} [kv={'on' if kv else 'off'}]"
            try:
                result = decode(model, [case["prompt_ids"]], case_policy(case), case["gen_length"], kv_cache=kv, record=True)
            except (ConfigError, ValueError) as err:
                yield Check(name, [f"cannot run: {err}"], decode=True)
                continue
            failures, values, traced = compare(case, observed(case, result, spec["mask_id"]))
            yield Check(name, failures, values, traced, decode=True)


def check_logits(model: Any, folder: Path, fixture: dict[str, Any]) -> Iterator[Check]:
    tensors = load_file(str(folder / fixture["file"]))
    device = model_device(model)
    ids, pos = tensors["input_ids"].to(device), tensors["position_ids"].to(device)
    n, length = ids.shape
    block = fixture["block_length"]
    blk = torch.arange(length) // block
    patterns = {
        "block_causal": blk[None, :] <= blk[:, None],
        "bidirectional": torch.ones(length, length, dtype=torch.bool),
    }
    for name, allowed in patterns.items():
        key = f"logits_{name}"
        if key not in tensors:
            continue
        with torch.inference_mode():
            got = model.forward_window(ids, pos, allowed.to(device).expand(n, -1, -1)).float().cpu()
        err = float((got - tensors[key]).abs().max())
        failures = [] if err <= LOGITS_TOLERANCE else [f"max abs logit error {err:.3g} > {LOGITS_TOLERANCE}"]
        yield Check(f"logits {name}", failures)
