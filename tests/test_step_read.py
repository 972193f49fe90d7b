"""The host read of an eager decode that reads every step, and the step context kept between steps
(issue 43, engine overhead).

:func:`~dlm_toolkit.decoding.read.read_every_row` brings every row's values to the host and computes
there what :func:`~dlm_toolkit.decoding.read.read_reduced` computes on the device (the engine's own
flags, the maxima over the live rows); the decode loop keeps the step context's positions and masks
under the read's ``context_key``. Pinned here against the reduced read and plain Python on random
states (a row that is not live holding the largest values: the near miss of the live masking), the
raise order (a flag pending from the step before comes before the engine's own), and every reused
context against the context built afresh in the same step, on a schedule whose window start moves
inside a block.
"""

from __future__ import annotations

import pytest
import torch

from dlm_toolkit import BLOCKS, DecodingPolicy, StrategyError, decode
from dlm_toolkit.decoding import loop
from dlm_toolkit.decoding.engine import ENGINE_FLAGS, StepEngine
from dlm_toolkit.decoding.policy import StepChecks
from dlm_toolkit.decoding.read import read_every_row, read_reduced
from dlm_toolkit.step.state import DecodeState
from dlm_toolkit.testing import ScriptedLM, tiny_llada2
from strategies.blocks_semi_ar import SemiAutoregressive

import test_step_overhead
import test_step_pins

MASK, EOS = 99, 98


def engine_and_state(seed: int, cached: bool, prefilled: bool, all_live: bool = False):
    """A decode of four rows mid-way: random blocks, cached lengths (at most the window start), post
    counters and mask counts; rows 0 and 1 live, row 2 not live with the largest values of all (with
    ``all_live``: every row live, row 2's values the maxima)."""
    g = torch.Generator().manual_seed(seed)
    model = tiny_llada2(seed=5)
    pol = DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4})
    state = DecodeState.start([[3, 4, 5], [6] * 9, [7] * 6, [8] * 2], 16, pol.blocks, model.mask_token_id,
                              model.eos_token_id, model.vocab_size, 0)
    engine = StepEngine(model, pol.blocks, state, cached, "eager", "inductor", trim=True)
    first = state.block.clone()
    state.block = first + torch.randint(0, 3, (4,), generator=g)
    state.block[2] = state.num_blocks[2] - 1
    lo, hi = pol.blocks.window(state, state.all_rows)
    if cached and prefilled:  # (not prefilled: the first read of a decode, nothing cached yet)
        engine.prefilled = True
        # the window start, a block before it, or off the block grid (a span of no whole number of blocks)
        back = torch.tensor([0, 4, 9])[torch.randint(0, 3, (4,), generator=g)]
        state.cache_len = torch.clamp(lo - back, min=0)
        state.cache_len[2] = 0
    state.post = torch.randint(0, 3, (4,), generator=g)
    state.post[2] = 9
    state.block_masked = torch.randint(0, 2, (4,), generator=g)
    state.block_masked[2] = 0
    live = torch.ones(4, dtype=torch.bool) if all_live else torch.tensor([True, bool(seed % 2), False, True])
    return engine, live, lo, hi, StepChecks(pol, 100)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cached, prefilled", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("all_live", [False, True])  # True: the read's every-row-live path (_max_live's every)
def test_the_read_of_every_row_gives_the_reduced_reads_facts_and_the_plain_maxima(seed, cached, prefilled, all_live):
    every = engine_and_state(seed, cached, prefilled, all_live)
    reduced = engine_and_state(seed, cached, prefilled, all_live)
    facts = read_every_row(*every, ENGINE_FLAGS)
    want = read_reduced(*reduced, ENGINE_FLAGS)
    assert (facts.read, facts.post_max, facts.post_any, facts.width) == (want.read, want.post_max, want.post_any,
                                                                         want.width)
    engine, live, lo, hi, _ = every
    state = engine.state
    rows = [r for r in range(4) if live[r]]
    his, los = hi.tolist(), lo.tolist()
    assert facts.post_max == max(state.post[r].item() for r in rows)  # not row 2's 9
    assert facts.post_any == any(state.block_masked[r].item() == 0 for r in rows)
    assert facts.live == tuple(rows) and facts.window_ends == (min(his), max(his))
    assert facts.context_key == (tuple(live.tolist()), tuple(his), tuple(los), tuple(state.block.tolist()))
    if cached:  # the cache columns a live row has filled; the prefill moved them to each live row's lo
        lens = reduced[0].state.cache_len.tolist() if prefilled else [los[r] if live[r] else 0 for r in range(4)]
        assert facts.needed == max(lens[r] for r in rows)
        assert state.cache_len.tolist() == reduced[0].state.cache_len.tolist() == lens
        prefill = not prefilled and facts.needed > 0  # a prefill forward when some live row has a prefix
        assert engine.state.forward_calls == reduced[0].state.forward_calls == int(prefill)
        assert (facts.layout_key is None) == (not prefilled)
    else:
        assert facts.needed == max(his[r] for r in rows) and facts.layout_key is None


def test_a_read_with_no_live_row_returns_none_on_both_reads():
    for read in (read_every_row, read_reduced):
        engine, live, lo, hi, checks = engine_and_state(0, True, True)
        assert read(engine, torch.zeros_like(live), lo, hi, checks, ENGINE_FLAGS) is None


@pytest.mark.parametrize("read", [read_every_row, read_reduced])
@pytest.mark.parametrize("case", ["pending", "engine", "not live"])
def test_a_flag_pending_from_the_step_before_is_raised_before_the_engines_own(read, case):
    state, ctx, pol = test_step_overhead.a_step(0)
    model = ScriptedLM(lambda ids, pos, attn: torch.zeros(*ids.shape, 100), 100, MASK, EOS)
    engine = StepEngine(model, pol.blocks, state, False, "eager", "inductor", trim=read is read_every_row)
    checks = StepChecks(pol, 30)
    if case == "pending":  # the step before selected outside its regions (a_step's random selections)
        checks.add(ctx, state)
    lo, hi = pol.blocks.window(state, state.all_rows)
    live = torch.tensor([True, True, False])
    wide = lo - 8  # two blocks in a window of one
    if case == "not live":  # the near miss: wide in the row that is not live only
        assert read(engine, live, torch.where(live, lo, wide), hi, checks, ENGINE_FLAGS) is not None
        return
    error = r"m2t rule 'topk' selected position" if case == "pending" else r"returned a window wider than its window"
    with pytest.raises(StrategyError, match=error):
        read(engine, live, wide, hi, checks, ENGINE_FLAGS)


@pytest.mark.parametrize("read", [read_every_row, read_reduced])
@pytest.mark.parametrize("overflow", [True, False])
def test_the_engines_overflow_flag_is_raised_by_both_reads(read, overflow):
    """The third of the engine's own flags (the window moved past the KV cache between reads), set on
    the engine as ``window()`` sets it; the near miss: not set, the read goes on."""
    engine, live, lo, hi, checks = engine_and_state(0, False, True)
    engine.overflow[...] = overflow
    if not overflow:
        assert read(engine, live, lo, hi, checks, ENGINE_FLAGS) is not None
        return
    with pytest.raises(StrategyError, match="more than one block past the KV cache"):
        read(engine, live, lo, hi, checks, ENGINE_FLAGS)

class _GrowingWindow(SemiAutoregressive):
    """``semi_ar`` with a two-block window that starts one position earlier each forward of a block
    (cache off): the window end and the block stay while the real slots grow."""

    def window_width(self) -> int:
        return 2 * self.block_length

    def window(self, state, rows):
        lo, hi = super().window(state, rows)
        return torch.maximum(lo - state.block_step[rows], hi - 2 * self.block_length).clamp(min=0), hi


if "_growing_window" not in BLOCKS.names():
    BLOCKS.register("_growing_window")(_GrowingWindow)


@pytest.mark.parametrize("blocks, align, kv", [("semi_ar", "absolute", True), ("semi_ar", "prompt", False),
                                               ("_two_block_window", "prompt", True),
                                               ("_growing_window", "absolute", False), ("dsb", "", True)])
def test_every_reused_step_context_is_the_context_built_afresh(blocks, align, kv, monkeypatch):
    built = loop.step_context
    hits = []

    def both(policy, state, live, lo, hi, logits, facts=None, saved=None):
        hit = facts is not None and facts.context_key is not None and facts.context_key == saved.key
        ctx = built(policy, state, live, lo, hi, logits, facts, saved)
        if hit:
            fresh = built(policy, state, live, lo, hi, logits)
            for name in ("positions", "tokens", "valid", "masked", "is_prompt", "in_block", "fillable", "editable",
                         "written_step", "written_conf", "post", "sampled"):
                assert torch.equal(getattr(ctx, name), getattr(fresh, name)), name
        hits.append(hit)
        return ctx

    monkeypatch.setattr(loop, "step_context", both)
    pol = test_step_pins.policy(blocks, align or "absolute", 4, **({"blocks.params.max_post_steps": 2} if blocks == "dsb"
                                                                   else {}))
    result = decode(test_step_pins.model(), test_step_pins.PROMPTS, pol, test_step_pins.GEN, kv_cache=kv)
    assert any(r.edits for r in result.rows)
    assert any(hits) == (blocks != "dsb")  # a dynamic block's bounds are data: never reused
