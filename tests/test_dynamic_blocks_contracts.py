"""The dynamic-block contract suite catches broken dynamic schedules (and passes DSB: see
tests/test_contracts.py::TestDSB)."""

from __future__ import annotations

import pytest
import torch

from dlm_toolkit.strategy.registry import BLOCKS
from dlm_toolkit.testing import DynamicBlockScheduleContract

DSB = BLOCKS.get("dsb")


class _OverlapsPrompt(DSB):  # the first block starts on the prompt's last token
    def first_bounds(self, state):
        lo, hi = super().first_bounds(state)
        return lo - 1, hi


class _LeavesCanvas(DSB):  # the block's end runs one past the canvas once it reaches the generation's end
    def next_bounds(self, state, ctx):
        lo, hi = super().next_bounds(state, ctx)
        return lo, torch.where(hi >= state.gen_end, state.length + 1, hi)


class _CachesUnfinishedGrid(DSB):  # caches up to the block start: a grid block's final part enters early
    def cache_boundary(self, state, rows, lo, hi):
        return lo


class _FinalSeesActive(DSB):  # every position up to the block's end in one group: cached keys go stale
    def attention_groups(self, state, rows, positions):
        groups = super().attention_groups(state, rows, positions)
        hi = state.block_hi[rows, None]
        return torch.where(positions < hi, hi, groups)


class _FinalShareGridWithActive(DSB):  # the final part of the active block's grid block joins it (not block-causal)
    def attention_groups(self, state, rows, positions):
        groups = super().attention_groups(state, rows, positions)
        lo = state.block_lo[rows, None]
        grid_start = lo - lo % self.block_length
        return torch.where((positions >= grid_start) & (positions < lo), lo // self.block_length + 1, groups)


class _MovesBack(DSB):  # the block start returns to the prompt's end every third forward
    def next_bounds(self, state, ctx):
        lo, hi = super().next_bounds(state, ctx)
        back = (state.nfe % 3 == 2) & (hi - state.prompt_len <= self.window_width())
        return torch.where(back, state.prompt_len, lo), hi


def _suite(rule_cls):
    return type("Suite", (DynamicBlockScheduleContract,), {
        "rule_factory": rule_cls, "configs": [{"block_length": 4, "max_block_length": 8, "max_post_steps": 1}]})()


@pytest.mark.parametrize("rule_cls, test, message", [
    (_OverlapsPrompt, "test_dynamic_bounds_inside_canvas_after_prompt", "overlaps the prompt"),
    (_LeavesCanvas, "test_dynamic_bounds_inside_canvas_after_prompt", "leaves the canvas"),
    (_MovesBack, "test_dynamic_bounds_inside_canvas_after_prompt", "moved back"),
    (_CachesUnfinishedGrid, "test_dynamic_attention_is_block_causal", "stale"),
    (_FinalSeesActive, "test_dynamic_attention_is_block_causal", "shares the active group"),
    (_FinalShareGridWithActive, "test_dynamic_attention_is_block_causal", "shares the active group"),
    (_CachesUnfinishedGrid, "test_kv_cache_matches_recompute_longer", "KV cache"),
    (_FinalSeesActive, "test_kv_cache_matches_recompute_longer", "KV cache"),
])
def test_suite_rejects_broken_dynamic_schedules(rule_cls, test, message):
    with pytest.raises(AssertionError, match=message):
        getattr(_suite(rule_cls), test)()


@pytest.mark.parametrize("test", ["test_dynamic_bounds_inside_canvas_after_prompt", "test_dynamic_attention_is_block_causal",
                                  "test_dynamic_positions_decoded_once_to_completion", "test_kv_cache_matches_recompute_longer"])
def test_suite_passes_dsb(test):
    getattr(_suite(DSB), test)()
