"""The capture contract every suite checks: a rule's step (and the model forward a schedule's
shapes give) compiles with ``torch.compile(fullgraph=True, dynamic=False)``, the CPU stand-in for a
CUDA graph, so a plug-in author learns on a laptop whether the rule can run inside a captured step.

Over whole decodes (several blocks, batch buckets 1 and 4) the suite asserts: no capture warning
(a host read such as ``.item()``, ``.tolist()``, ``nonzero`` or a boolean index, or a graph break,
makes the engine run the rule eagerly with one warning naming it), at most one compilation per
input layout (batch bucket, window width, memory layout), and the tokens and NFE of the eager
decode. The graphs are traced with the ``aot_eager`` backend: the same graph ``inductor`` gets,
without generating code, so the check takes seconds.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from dlm_toolkit.strategy.base import Strategy
from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits

engine = importlib.import_module("dlm_toolkit.decoding.loop")  # the package exports the function under this name


class _UncountedLM(ScriptedLM):
    """A scripted model whose forward has no Python side effect (``ScriptedLM`` counts its calls in a
    Python int, which a compiled forward would guard on and recompile for at every call)."""

    def forward_window(self, input_ids, position_ids, attn_mask, cache=None, cache_rows=None, cache_write=None):
        return self.fn(input_ids, position_ids, attn_mask).float()


def capture_problems(rule: Strategy, policy: Any, prompts_sets: tuple[list[list[int]], ...] = (
        [[1, 2, 3]], [[1, 2, 3], [4, 5], [6, 7, 8, 9]]), gen_length: int = 9) -> list[str]:
    """What keeps ``rule`` (in ``policy``) from being captured, as sentences (empty: capture-safe)."""
    vocab = 24
    model = _UncountedLM(mixing_logits(vocab, seed=1, scale=2.5, mix=2.0), vocab, vocab - 1, vocab - 2)
    problems: list[str] = []
    backend, engine.COMPILE_BACKEND = engine.COMPILE_BACKEND, "aot_eager"
    try:
        for prompts in prompts_sets:
            eager = engine.decode(model, prompts, policy, gen_length, seed=0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                captured = engine.decode(model, prompts, policy, gen_length, seed=0, capture="compile")
            problems += [str(w.message) for w in caught if "cannot be captured" in str(w.message)]
            if captured.tokens != eager.tokens or [r.nfe for r in captured.rows] != [r.nfe for r in eager.rows]:
                problems.append(f"{rule!r}: the captured decode of {len(prompts)} rows differs from the eager one")
    finally:
        engine.COMPILE_BACKEND = backend
    for key, value in engine.shared(model).items():
        runner = value[0] if key[0] == "rule" else value if key[0] == "step" else None
        if runner is not None and runner.compilations > 1:
            problems.append(f"{runner.name} compiled {runner.compilations} times for one input layout")
    return list(dict.fromkeys(problems))


class _CaptureContract:
    """Mixed into every suite (see the module docstring)."""

    def test_capture_safe(self) -> None:
        rule = self.rules()[0]  # type: ignore[attr-defined]
        problems = capture_problems(rule, self.policy_for(rule))  # type: ignore[attr-defined]
        assert not problems, f"{rule!r} is not capture-safe: " + "; ".join(problems)
