"""The cached step window's attention mask in one comparison of groups (segments.window_with_cache,
the engine's fast path in ``arguments``) against the general path it replaces: ``cache_seen`` of the
cached keys next to ``layout``'s mask of the window, on random windows (negative and equal groups,
padding slots, cache columns on both sides of each row's cached length), and which segments take it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlm_toolkit.step.segments import Keys, Segment, cache_seen, layout, plain_window, window_with_cache


def a_window(seed: int, n: int = 3, t: int = 6, s: int = 9) -> tuple[Segment, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    group = torch.randint(-2, 3, (n, t), generator=g).sort(1).values  # groups rise along a window
    real = torch.rand(n, t, generator=g) < 0.7
    real[0] = True  # a row with no padding
    real[1, :] = False  # a row that is not live
    cache_group = torch.randint(-2, 3, (n, s), generator=g).sort(1).values
    cached = torch.randint(0, s + 1, (n,), generator=g)
    cached[0] = s  # the whole cache, and (row 1) none of it
    cached[1] = 0
    not_cached = torch.arange(s) >= cached[:, None]
    seg = Segment(ids=torch.randint(0, 50, (n, t), generator=g), pos=torch.arange(t).repeat(n, 1), real=real,
                  group=group)
    return seg, not_cached, cache_group


@pytest.mark.parametrize("seed", range(6))
def test_the_one_comparison_mask_is_the_general_mask(seed):
    seg, not_cached, cache_group = a_window(seed)
    eye = torch.eye(seg.width, dtype=torch.bool)
    general = torch.cat([cache_seen([seg], ~not_cached, cache_group), layout([seg], eye)[2]], -1)
    fast = window_with_cache(seg, not_cached, cache_group, eye)
    assert fast.dtype == torch.bool and fast.shape == general.shape
    assert torch.equal(fast, general)
    # independent of both: a real query sees the cached keys of its group or earlier, the real window
    # keys of its group or earlier, and itself; a padding query only itself
    for r in range(3):
        for q in range(seg.width):
            for k in range(fast.shape[2]):
                if k < not_cached.shape[1]:
                    want = bool(seg.real[r, q]) and not not_cached[r, k] and cache_group[r, k] <= seg.group[r, q]
                else:
                    j = k - not_cached.shape[1]
                    want = j == q or (bool(seg.real[r, q] & seg.real[r, j]) and seg.group[r, j] <= seg.group[r, q])
                assert bool(fast[r, q, k]) == want, (r, q, k)


def test_which_segments_take_the_one_comparison():
    seg, _, _ = a_window(0)
    assert plain_window([seg])
    near = [dataclasses.replace(seg, order=seg.group), dataclasses.replace(seg, see_cache=False),
            dataclasses.replace(seg, see_self=Keys.BEFORE), dataclasses.replace(seg, group=None),
            dataclasses.replace(seg, own=torch.ones(3, seg.width, seg.width, dtype=torch.bool))]
    assert [plain_window([s]) for s in near] == [False] * len(near)
    assert not plain_window([seg, seg])
