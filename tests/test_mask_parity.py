"""Reference parity with the mask token inside the softmax, and no output that holds the mask id.

The reference (``conformance/reference.py``, an independent transcription of the LLaDA2.1
``generate()``) keeps ``<|mask|>`` in the softmax. On random models whose mask row is a row like any
other, that matters two ways: some threshold/fallback decisions differ from what a softmax without
the mask gives (the engine must take the reference's), and at some positions the mask token is the
argmax (the reference would write it and loop forever; the engine writes the best real token).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from dlm_toolkit.evaluation.conformance import case_policy, observed
from dlm_toolkit.decoding.loop import decode
from dlm_toolkit.decoding.policy import DecodingPolicy
from dlm_toolkit.strategy.registry import M2T, REMASK, T2T
from dlm_toolkit.testing.models import tiny_llada2

from conformance.reference import MaskDrawn, reference_decode

MASK, EOS = 63, 62
# (threshold, editing_threshold or None for editing off, max_post_steps): the Q, S and 2.0 presets
MODES = {"q": (0.7, 0.5, 16), "s": (0.5, 0.0, 16), "2.0": (0.95, None, 0)}


def make_case(seed: int, mode: str) -> dict[str, Any]:
    rng = random.Random(seed * 31 + len(mode))
    threshold, editing, post = MODES[mode]
    return {
        "prompt_ids": [rng.randrange(0, EOS) for _ in range(rng.randrange(3, 12))],
        "gen_length": 32,
        "block_length": 8,
        "threshold": threshold,
        "editing": "on" if editing is not None else "off",
        "editing_threshold": editing if editing is not None else 2.0,
        "max_post_steps": post,
        "eos_early_stop": True,
    }


def run_reference(model, case: dict[str, Any], mask_in_softmax: bool = True) -> dict[str, Any]:
    return reference_decode(
        lambda ids, pos, attn: model.forward_window(ids, pos, attn),
        case["prompt_ids"], case["gen_length"], block_length=case["block_length"], threshold=case["threshold"],
        editing_threshold=case["editing_threshold"], max_post_steps=case["max_post_steps"],
        eos_early_stop=case["eos_early_stop"], mask_id=MASK, eos_id=EOS, mask_in_softmax=mask_in_softmax,
    )


def engine(model, case: dict[str, Any], kv: bool) -> dict[str, Any]:
    result = decode(model, [case["prompt_ids"]], case_policy(case), case["gen_length"], kv_cache=kv, record=True)
    return observed(case, result, mask_id=MASK)


def test_engine_takes_the_reference_decision_on_models_whose_mask_row_is_not_zeroed():
    kinds = {"exact": 0, "mask_decides": 0, "mask_drawn": 0}
    for seed in range(8):
        model = tiny_llada2(seed, keep_mask_row=True)
        for mode in MODES:
            case = make_case(seed, mode)
            try:
                want = run_reference(model, case)
            except MaskDrawn:
                kinds["mask_drawn"] += 1
                for kv in (True, False):
                    got = engine(model, case, kv)
                    assert got["no_mask_in_output"] and MASK not in got["final_canvas"], (seed, mode, kv)
                continue
            kinds["exact"] += 1
            try:
                kinds["mask_decides"] += run_reference(model, case, mask_in_softmax=False)["trace"] != want["trace"]
            except MaskDrawn:
                pass
            for kv in (True, False):
                got = engine(model, case, kv)
                assert got["output_ids"] == want["output_ids"] and got["nfe"] == want["nfe"], (seed, mode, kv)
                assert got["trace"] == want["trace"], (seed, mode, kv)
    # the cases must exercise all three situations, or the test proves nothing about the mask
    assert kinds["exact"] >= 12 and kinds["mask_decides"] >= 1 and kinds["mask_drawn"] >= 1, kinds


class MaskArgmax:
    """A model whose mask logit beats every other token everywhere: the degenerate extreme."""

    def __init__(self, model, boost: float = 1e3) -> None:
        self.inner, self.boost = model, boost

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_window(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = self.inner.forward_window(*args, **kwargs).clone()
        logits[..., self.inner.mask_token_id] += self.boost
        return logits


def _builtin(registry) -> list[str]:
    # not rules other tests register; not 'reference', which runs only on an oracle model's joint (it refuses
    # this random model at build: tests/test_oracle_reference.py checks it on the oracles)
    return [e.name for e in registry.entries() if e.source == "built-in" and e.name != "reference"]


def _policies() -> list[tuple[str, dict[str, Any]]]:
    base = {"blocks": {"name": "semi_ar", "params": {"block_length": 8, "max_post_steps": 4, "eos_early_stop": True}}}
    out = [(f"m2t={name}", base | {"m2t": {"name": name}}) for name in _builtin(M2T)]
    out += [(f"t2t={name}", base | {"m2t": {"name": "threshold"}, "t2t": {"name": name}}) for name in _builtin(T2T)]
    out += [(f"remask={name}", base | {"m2t": {"name": "threshold"}, "t2t": {"name": "threshold"}, "remask": {"name": name}})
            for name in _builtin(REMASK)]
    return out


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 5}, {"temperature": 0.7, "top_p": 0.9}],
                         ids=["greedy", "t1-topk", "t07-topp"])
def test_no_output_ever_holds_the_mask_id(sampling: dict[str, Any]):
    model = MaskArgmax(tiny_llada2(3, keep_mask_row=True))
    prompts = [[5, 9, 11], [40, 2, 7, 30, 21, 8, 1]]
    for label, spec in _policies():
        result = decode(model, prompts, DecodingPolicy(spec | {"sampling": sampling}), 24, seed=1, record=True)
        for row in result.rows:
            assert MASK not in row.tokens, label
        for step in result.trajectory.steps:
            written = [step.sampled[step.positions.index(p)] for p in step.commit + step.edit]
            assert MASK not in written, (label, step)
