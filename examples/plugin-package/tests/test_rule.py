"""The example rule against the toolkit's M2T contract suite, plus one hand-made case."""

import math

import torch

from dlm_example_plugin.rules import ConfidenceRatioUnmask
from dlm_toolkit.testing import UnmaskRuleContract, make_context


class TestConfidenceRatio(UnmaskRuleContract):
    rule_factory = ConfidenceRatioUnmask
    configs = [{}, {"ratio": 1.0}, {"ratio": 50.0}]


def test_ratio_gate():
    mask = 5
    probs = [[0.4, 0.05, 0.05, 0.25, 0.25], [0.5, 0.3, 0.1, 0.05, 0.05], [0.2] * 5]
    logits = torch.tensor([[[math.log(p) for p in row] + [float("-inf")] for row in probs]])
    ctx = make_context(torch.full((1, 3), mask), logits, mask_token_id=mask)
    assert ConfidenceRatioUnmask(ratio=1.5)(ctx).tolist() == [[True, True, False]]
    assert ConfidenceRatioUnmask(ratio=4.0)(ctx).tolist() == [[False, True, False]]  # none clears 4: the largest ratio (0.5 / 0.3)
