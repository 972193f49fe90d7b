"""Behaviours of the decode step that change output and that no other test pinned (issue 43).

- ``forward_tokens`` counted independently: from the recorded steps (each row's window ``[lo, hi)``,
  whether it verified) and the layout rules of the engine's docstring (cache on: a prefill of
  ``[0, first lo)``, then every forward the positions from the cached length to ``hi``, the cached
  length then moving to ``lo``; cache off: the canvas up to ``hi``; a verification forward adds
  its span and a block), never from the counter under test;
- the fast paths of the eager decode that reads every step (the trimmed forward, the reused layout,
  the write inside the canvas, the schedule's skipped block ends) against the general path (the
  same decode with ``check_every=2``, which takes none of the engine's, and the schedule handed
  :data:`~dlm_toolkit.step.facts.UNKNOWN` facts, so it takes none of its own) on ``align: prompt`` and
  ``absolute``, cache on and off, a plug-in schedule whose window spans two blocks, dynamic blocks
  and a batch whose rows finish at different steps;
- a segment's ``see_cache=False`` and a segment without ``pos`` / ``real``.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from dlm_toolkit import BLOCKS, T2T, DecodingPolicy, StrategyError, decode
from dlm_toolkit.hooks import StepHook
from dlm_toolkit.step.facts import UNKNOWN, StepFacts
from dlm_toolkit.step.segments import Keys, Segment
from dlm_toolkit.testing import tiny_llada2
from strategies.blocks_semi_ar import SemiAutoregressive
from strategies.t2t_none import NoEdit

GEN = 24
# rows of different lengths; on this model three of them stop at an EOS while the others go on in the same
# block (a step layout reused without looking at which rows are live counts the stopped rows again)
_DRAW = torch.Generator().manual_seed(5)
PROMPTS = [torch.randint(0, 60, (n,), generator=_DRAW).tolist() for n in (3, 12, 5, 2, 9, 7)]


class TwoBlockWindow(SemiAutoregressive):
    """A plug-in ``semi_ar`` whose context window spans the active block and the one before it
    (only the active block is real: the window's first block is padding or the block before)."""

    def window_width(self) -> int:
        return 2 * self.block_length


if "_two_block_window" not in BLOCKS.names():
    BLOCKS.register("_two_block_window")(TwoBlockWindow)


@lru_cache(maxsize=None)
def model():
    return tiny_llada2(seed=5)


def policy(blocks: str = "semi_ar", align: str = "absolute", block: int = 4, **more) -> DecodingPolicy:
    params = {"block_length": block, "max_post_steps": 2, "eos_early_stop": True}
    if blocks != "dsb":
        params["align"] = align
    return DecodingPolicy("llada2.1-q", **{"blocks.name": blocks, **{f"blocks.params.{k}": v for k, v in params.items()},
                                           **more})


def counted(result, cached: bool, window_width: int, block_length: int) -> list[int]:
    """Each row's ``forward_tokens`` from its recorded steps and the engine's layout rules (module
    docstring), for schedules whose cache boundary is the window start."""
    totals, cache_len = [0] * len(result.rows), [None] * len(result.rows)
    for s in result.trajectory.steps:
        r, lo, hi = s.row, s.positions[0], s.positions[-1] + 1
        if cached:
            if cache_len[r] is None:  # the prefill before the first step: [0, boundary)
                totals[r] += lo
                cache_len[r] = lo
            totals[r] += hi - cache_len[r]
            cache_len[r] = lo
            if s.verified:  # the window's span after the step (cache at lo) and the masked copy of the block
                totals[r] += hi - max(lo, hi - window_width) + block_length
        else:
            totals[r] += hi
            if s.verified:
                totals[r] += hi + block_length
    return totals


def outcome(result) -> tuple:
    """Everything a decode gives but ``forward_calls`` (more with ``check_every`` > 1: rows that finished
    between reads ride along)."""
    return (result.tokens,
            [(r.nfe, r.forward_tokens, r.commits, r.edits, r.post_forwards, r.blocks_decoded, r.eos_stopped)
             for r in result.rows])


CASES = [  # (schedule, align, kv_cache, block_length, more policy settings)
    ("semi_ar", "absolute", True, 4, {}),
    ("semi_ar", "absolute", False, 4, {}),
    ("semi_ar", "prompt", True, 4, {}),
    ("semi_ar", "prompt", False, 4, {}),  # the trimmed width without the cache rounds up to whole blocks
    ("semi_ar", "prompt", False, 8, {}),
    ("_two_block_window", "absolute", True, 4, {}),  # the window starts before position 0 in some rows only
    ("_two_block_window", "prompt", True, 4, {}),
    ("_two_block_window", "absolute", False, 4, {}),
    ("semi_ar", "absolute", True, 4, {"m2t.name": "s2d2"}),  # verification forwards
    ("semi_ar", "absolute", False, 4, {"m2t.name": "s2d2"}),
    ("semi_ar", "prompt", False, 4, {"m2t.name": "s2d2"}),
]


def general(pol: DecodingPolicy, kv: bool, monkeypatch, **kw):
    """The decode on the general path: ``check_every=2`` and a schedule that knows no facts."""
    cls = type(pol.blocks)
    prepare, finish_step = cls.prepare, cls.finish_step
    with monkeypatch.context() as patch:
        patch.setattr(cls, "prepare", lambda self, state, facts: prepare(self, state, UNKNOWN))
        patch.setattr(cls, "finish_step", lambda self, state, ctx, facts: finish_step(self, state, ctx, UNKNOWN))
        return decode(model(), PROMPTS, pol, GEN, kv_cache=kv, capture="eager", check_every=2, **kw)


@pytest.mark.parametrize("blocks, align, kv, block, more", CASES)
def test_forward_tokens_equal_an_independent_count_and_the_fast_paths_the_general_path(blocks, align, kv, block,
                                                                                      more, monkeypatch):
    pol = policy(blocks, align, block, **more)
    fast = decode(model(), PROMPTS, pol, GEN, kv_cache=kv, capture="eager", record=True)
    assert outcome(fast) == outcome(general(pol, kv, monkeypatch))
    # check_every=2 with the facts: the schedule's fast paths on steps between reads
    assert outcome(fast) == outcome(decode(model(), PROMPTS, pol, GEN, kv_cache=kv, capture="eager", check_every=2))
    want = counted(fast, kv, pol.blocks.window_width(), block)
    assert [r.forward_tokens for r in fast.rows] == want
    # the batch has rows that finish while others decode (the reuse must see which rows are live)
    assert len({r.nfe for r in fast.rows}) > 1 and any(r.eos_stopped for r in fast.rows)


def test_dynamic_blocks_fast_paths_equal_the_general_path(monkeypatch):
    for kv in (True, False):
        fast = decode(model(), PROMPTS, policy("dsb"), GEN, kv_cache=kv, capture="eager")
        assert outcome(fast) == outcome(general(policy("dsb"), kv, monkeypatch))


def test_facts_of_a_step_without_a_read_keep_only_what_still_holds():
    read = StepFacts(read=True, post_max=3, since=0, post_any=True, window_ends=(8, 16), width=12, needed=9,
                     live=(0, 2), layout_key=("k",), cache_moves=False)
    later = read.later().later()
    assert later == StepFacts(read=False, post_max=3, since=2, width=12)
    with pytest.raises(AttributeError):  # a value: no stage can change what another reads
        read.post_max = 0  # type: ignore[misc]


# -- segments: see_cache, and the fields that must be tensors ---------------------------------------

class OwnOnly(StepHook):
    """Appends a copy of the window's real slots that sees nothing but its own real slots
    (``see_cache`` as given); records its logits, ids and positions per step."""

    def __init__(self, see_cache: bool):
        self.see_cache, self.records = see_cache, []

    def step_segments(self, engine, state, live, window):
        self.records.append([window.ids, window.pos, window.real])
        return [Segment(window.ids, window.pos, window.real, window.group, see_cache=self.see_cache,
                        see_self=Keys.ALL)]

    def after_forward(self, ctx, engine, state):
        (logits,) = engine.segment_logits(self)
        self.records[-1].append(logits)


HOOKS: list[StepHook] = []


class WithHooks(NoEdit):
    def step_hooks(self, policy, role):
        return list(HOOKS)


if "_pins_hook" not in T2T.names():
    T2T.register("_pins_hook")(WithHooks)


def run_hook(hook: StepHook, kv: bool):
    HOOKS[:] = [hook]
    pol = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 1.0}}, "t2t": {"name": "_pins_hook"},
                          "blocks": {"name": "semi_ar", "params": {"block_length": 4, "max_post_steps": 0}}})
    return decode(model(), [[5, 6, 7, 8, 9, 10, 11, 12]], pol, 8, kv_cache=kv, capture="eager")


def check_own_only(hook: OwnOnly) -> int:
    """Compare every recorded segment logit with a plain forward of the model over the segment's
    real slots alone (each sees every other one); the number of slots compared."""
    n = 0
    for ids, pos, real, logits in hook.records:
        seg, ids, pos = logits[0][real[0]], ids[0][real[0]], pos[0][real[0]]
        attn = torch.ones(1, len(ids), len(ids), dtype=torch.bool)
        with torch.inference_mode():
            want = model()(ids[None], pos[None], attn)[0]
        torch.testing.assert_close(seg, want, atol=2e-4, rtol=2e-4)
        n += len(ids)
    return n


def test_a_segment_that_does_not_see_the_cache_sees_only_its_own_slots():
    hook = OwnOnly(see_cache=False)
    run_hook(hook, kv=True)
    assert check_own_only(hook) > 0
    near = OwnOnly(see_cache=True)  # the near miss: the same segment seeing the cached prompt differs
    run_hook(near, kv=True)
    with pytest.raises(AssertionError):
        check_own_only(near)


class NoneField(StepHook):
    def __init__(self, field: str):
        self.field, self.name = field, f"hook 'none_{field}'"

    def step_segments(self, engine, state, live, window):
        parts = {"ids": window.ids, "pos": window.pos, "real": window.real, "group": window.group}
        parts[self.field] = None
        return [Segment(**parts)]


@pytest.mark.parametrize("field", ["ids", "pos", "real"])
def test_a_segment_without_ids_positions_or_real_slots_is_refused_naming_the_field(field):
    with pytest.raises(StrategyError, match=rf"^hook 'none_{field}' \(step_segments\): segment field '{field}' must be"):
        run_hook(NoneField(field), kv=True)


def test_a_segment_without_groups_or_order_is_accepted():  # the near miss: optional fields may be None
    class NoOrder(NoneField):
        def step_segments(self, engine, state, live, window):
            return [Segment(window.ids, window.pos, window.real, window.group, order=None, write=None)]

    run_hook(NoOrder("order"), kv=True)
