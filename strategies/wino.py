"""WINO, "Wide-In, Narrow-Out: Revokable Decoding for Efficient and Effective DLLMs" (Hong et al.,
arXiv 2507.18578), as a commit rule and a remask rule used together (``m2t: wino``, ``remask: wino``).

Algorithm (the paper's decoding loop, one forward per step, inside the active block):

1. *wide-in* (M2T ``wino``): draft every masked position whose confidence is > tau_1, a low
   threshold (at least the most confident one, so every step makes progress);
2. *narrow-out* (remask ``wino``): re-verify the tokens drafted in earlier steps of the block and
   turn back into masks those whose probability now, p(x_i | canvas), is < tau_2 (a high
   threshold), lowest first, at most (drafts this step - 1) per row so every step keeps net progress.

Defaults: tau_1 = 0.6, tau_2 = 0.9, our reading of the paper's main LLaDA setting.
Choices where this toolkit differs from the paper (both noted so results are read correctly):

* The paper verifies a drafted token with the token itself hidden, in a *shadow block* appended
  to the same forward: ``remask: wino_shadow`` does that (:mod:`dlm_toolkit.hooks.shadow`: a masked
  copy of the active block after the window, copy position i sees the block without x_i; no
  extra NFE). ``remask: wino`` takes the probability from the same forward with the token visible
  (``ctx.token_confidence``), which is cheaper and more lenient (a token tends to support itself).
* Verification covers the written tokens of the active block that M2T did not commit in this
  very step (the contract: ``remaskable``), which in a block without edits are exactly WINO's
  earlier drafts.

The narrow-out test is the one ``low_confidence`` applies; ``wino`` reuses it with the paper's
tau_2, so the two stay one implementation.
"""

from __future__ import annotations

from pydantic import Field

import torch

from dlm_toolkit import M2T, REMASK, StepContext, StrategyError
from dlm_toolkit.hooks.shadow import Shadow
from strategies.m2t_threshold import ThresholdUnmask
from strategies.remask_low_confidence import LowConfidenceRemask


@M2T.register("wino")
class WinoWideIn(ThresholdUnmask):
    """Wide-in: draft every mask with confidence > tau_1 (at least one per step)."""

    class Config(ThresholdUnmask.Config):
        threshold: float = Field(0.6, gt=0.0, le=1.0, description="tau_1: draft iff confidence > tau_1 (wide-in)")


@REMASK.register("wino")
class WinoNarrowOut(LowConfidenceRemask):
    """Narrow-out: re-mask earlier drafts whose probability now is < tau_2 (lowest first, net progress kept)."""

    class Config(LowConfidenceRemask.Config):
        threshold: float = Field(0.9, gt=0.0, le=1.0, description="tau_2: re-mask iff p(drafted token) < tau_2 (narrow-out)")


@REMASK.register("wino_shadow")
class WinoShadowNarrowOut(WinoNarrowOut, Shadow):
    """Narrow-out as the paper verifies it: re-mask earlier drafts whose probability *with the draft
    itself hidden* (the shadow block, ``ctx.shadow_confidence``) is < tau_2."""

    def support(self, ctx: StepContext) -> torch.Tensor:
        support = ctx.hooks.get("shadow_confidence")
        if support is None:  # a context built by hand, or a policy that bypassed the engine
            raise StrategyError(f"remask rule '{self.name}' reads ctx.shadow_confidence, which only the decode "
                                "engine fills (dlm_toolkit.hooks.shadow); pass shadow_confidence= to make_context")
        return support
