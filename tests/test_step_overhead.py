"""Engine overhead, round 2 (issue 36): the fused step checks, the counter row of a write, the device
flags kept as set until the read, and the step forward's layout reused within a block. Each is
checked against an independent reference: Python loops over plain lists, or the general path that
the fast one skips (the same step through a context whose rows are not the decode's own tensor; a
decode with the reuse switched off, forward by forward).
"""

from __future__ import annotations

import math

import pytest
import torch

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.decoding import engine as engine_module
from dlm_toolkit.step.canvas import write_step
from dlm_toolkit.step.facts import UNKNOWN, StepFacts
from dlm_toolkit.step.flags import DeviceFlag, FlagBoard, FlagTable, StrategyError, pending_payload
from dlm_toolkit.decoding.loop import step_context
from dlm_toolkit.step.state import COUNTERS, DecodeState
from dlm_toolkit.decoding.policy import CHECKS, StepChecks
from dlm_toolkit.testing import tiny_llada2
from strategies.blocks_semi_ar import SemiAutoregressive

MASK, EOS, VOCAB = 99, 98, 100


def policy(**more: object) -> DecodingPolicy:
    return DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 8, **more})


def unproven() -> DecodingPolicy:
    """``policy()`` with rules that declare no guarantees (decoding.policy.guaranteed): every step check
    is computed."""
    return DecodingPolicy({"m2t": {"name": "topk"}, "t2t": {"name": "margin"}, "remask": {"name": "low_confidence"},
                           "blocks": {"name": "semi_ar", "params": {"block_length": 8}}, "sampling": {"temperature": 0}})


def a_step(seed: int, rows_tensor: str = "own") -> tuple[DecodeState, object, DecodingPolicy]:
    """A state of three rows (one not live) with a random canvas and a context whose selections are
    random (inside and outside their regions), some confidences non-finite."""
    g = torch.Generator().manual_seed(seed)
    pol = unproven()
    state = DecodeState.start([[1, 2, 3], [4] * 11, [5] * 6], 20, pol.blocks, MASK, EOS, VOCAB, 0)
    gen = torch.rand(state.canvas.shape, generator=g) < 0.5
    state.canvas = torch.where(gen & (state.written_step < 0) & (torch.arange(state.canvas.shape[1]) >= 11),
                               torch.randint(0, 90, state.canvas.shape, generator=g), state.canvas)
    state.block_step[:] = torch.randint(0, 60, (3,), generator=g)
    state.counts[:, 0] = torch.randint(0, 5, (3,), generator=g)
    live = torch.tensor([True, True, False])
    lo, hi = pol.blocks.window(state, state.all_rows)
    ctx = step_context(pol, state, live, lo, hi, torch.randn(3, 8, VOCAB, generator=g))
    ctx.commit = torch.rand(3, 8, generator=g) < 0.3
    ctx.edit = torch.rand(3, 8, generator=g) < 0.2
    ctx.remask = torch.rand(3, 8, generator=g) < 0.2
    ctx.confidence = ctx.confidence.masked_fill(torch.rand(3, 8, generator=g) < 0.1, math.nan)
    if rows_tensor == "copy":  # the same rows, not the decode's own tensor: the general path
        ctx.rows = state.all_rows.clone()
    return state, ctx, pol


def plain_checks(ctx: object, state: DecodeState, limit: int) -> list[list[bool]]:
    """The eight checks of StepChecks.NAMES by their documented definitions, row by row."""
    out = []
    for r in range(ctx.rows.shape[0]):
        commit, edit, remask = (getattr(ctx, k)[r].tolist() for k in ("commit", "edit", "remask"))
        fill, editable, valid = ctx.fillable[r].tolist(), ctx.editable[r].tolist(), ctx.valid[r].tolist()
        in_block = ctx.in_block[r].tolist()
        has_masks = any(fill)
        remaskable = [e and not d and b and has_masks for e, d, b in zip(editable, edit, in_block)]
        net = sum(commit) - sum(remask)
        over = int(state.block_step[r]) > limit
        conf = ctx.confidence[r].tolist()
        out.append([
            any(s and not a for s, a in zip(commit, fill)),
            any(s and not a for s, a in zip(edit, editable)),
            any(s and not a for s, a in zip(remask, remaskable)),
            has_masks and not any(commit),
            has_masks and any(remask) and net < 1,
            False,  # no verification in this policy
            bool(ctx.live[r]) and over,
            any(v and not math.isfinite(c) for v, c in zip(valid, conf)),
        ])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_fused_step_checks_match_the_plain_definitions(seed):
    state, ctx, pol = a_step(seed)
    ctx.confidence[2, 0] = math.inf  # not a real slot (row 2 is not live): no finite check there
    checks = StepChecks(pol, 30)
    assert [f.name for f in checks.flags] == [n for n in StepChecks.NAMES if n != "verify"]
    checks.add(ctx, state)
    board = state.flags
    slab = board.slabs["+".join(f.name for f in checks.flags)]
    want = [row[:5] + row[6:] for row in plain_checks(ctx, state, 30)]
    assert slab.tolist() == want
    assert board.fresh == {"+".join(f.name for f in checks.flags): 1}


@pytest.mark.parametrize("value,bad", [
    (math.inf, True), (-math.inf, True), (math.nan, True),
    # near misses: the largest finite float32 values (x - x is still 0), the smallest subnormal, -0.0
    (3.4028234663852886e38, False), (-3.4028234663852886e38, False), (1e-45, False), (-0.0, False),
])
def test_the_finite_check_is_isfinite_at_real_slots(value, bad):
    """The finite column (confidence - confidence compared with itself) against math.isfinite, with the
    value at a real slot of row 0 and, in row 1, only at a slot that is not real (never flagged)."""
    state, ctx, pol = a_step(1)
    ctx.confidence = torch.full((3, 8), 0.5)
    ctx.valid = torch.zeros(3, 8, dtype=torch.bool)
    ctx.valid[0, 3] = ctx.valid[1, 5] = True
    ctx.confidence[0, 3] = ctx.confidence[1, 4] = value
    checks = StepChecks(pol, 10 ** 6)
    checks.add(ctx, state)
    names = [f.name for f in checks.flags]
    slab = state.flags.slabs["+".join(names)].tolist()
    assert [row[names.index("finite")] for row in slab] == [bad, False, False]
    assert bad is not math.isfinite(value)


@pytest.mark.parametrize("commit_row0", [True, False])
def test_checks_on_their_bounds(commit_row0):
    """Hand-made rows on the bounds: net progress exactly 1 passes, 0 fails; no commit fails progress
    but not net; a remask on a slot edited in the same step is outside the remask region, the same
    slot not edited is inside; block_step at the limit passes, one past fails."""
    state, ctx, pol = a_step(0)
    ctx.valid = ctx.valid | ctx.live[:, None]
    ctx.confidence = torch.zeros(3, 8)
    ctx.commit = torch.zeros(3, 8, dtype=torch.bool)
    ctx.edit = torch.zeros(3, 8, dtype=torch.bool)
    ctx.remask = torch.zeros(3, 8, dtype=torch.bool)
    fill = ctx.fillable
    first = [int(fill[r].nonzero()[0, 0]) for r in range(2)]
    ctx.commit[0, first[0]] = commit_row0  # row 0: one commit (fine) or none (no progress, but net is not the issue)
    ctx.commit[1, first[1]] = True  # row 1: one commit and one remask: net 0
    slots = (ctx.editable[1] & ctx.in_block[1]).nonzero()[:, 0].tolist()
    assert len(slots) >= 2, "the fixture must leave two editable slots in row 1"
    ctx.remask[1, slots[0]] = True
    ctx.edit[1, slots[0]] = not commit_row0  # edited too: then outside the remask region
    state.block_step[:] = torch.tensor([30, 31, 31])  # limit 30: row 0 at it, row 1 past, row 2 not live
    checks = StepChecks(pol, 30)
    checks.add(ctx, state)
    slab = state.flags.slabs["+".join(f.name for f in checks.flags)].tolist()
    names = [f.name for f in checks.flags]
    got0 = {n: slab[0][names.index(n)] for n in ("progress", "net", "limit", "remask")}
    assert got0 == {"progress": not commit_row0, "net": False, "limit": False, "remask": False}
    got1 = {n: slab[1][names.index(n)] for n in ("progress", "net", "limit", "remask", "finite")}
    assert got1 == {"progress": False, "net": True, "limit": True, "remask": not commit_row0, "finite": False}
    assert slab[2][names.index("limit")] is False


def test_the_verify_check_is_kept_for_a_verifying_policy():
    pol = DecodingPolicy({"m2t": {"name": "s2d2"}, "blocks": {"name": "semi_ar", "params": {"block_length": 8}}})
    assert "verified" in pol.hook_outputs
    assert [f.name for f in StepChecks(pol, 10).flags] == list(StepChecks.NAMES)
    assert [f.name for f in StepChecks(unproven(), 10).flags] == [n for n in StepChecks.NAMES if n != "verify"]


@pytest.mark.parametrize("no_remask", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_write_step_for_the_loops_context_matches_the_row_path(seed, no_remask):
    """Both paths against the counter row by hand; ``no_remask`` (the counter row without its remask
    column) leaves the remasks counter as it was."""
    results = []
    for rows in ("own", "copy"):
        state, ctx, _ = a_step(seed, rows)
        ctx.remask &= ~(ctx.commit | ctx.edit)
        if no_remask:
            ctx.remask = torch.zeros_like(ctx.remask)
        state.counts[:, COUNTERS.index("remasks")] = 7  # must stay 7 (+ the remasks) whichever path counts
        ctx.commit &= ctx.valid  # a valid step: nothing selected outside the live rows
        ctx.edit &= ctx.valid
        ctx.remask &= ctx.valid
        ctx.post = ctx.live & torch.tensor([False, True, False])
        ctx.confidence = ctx.confidence.nan_to_num(0.5)  # NaN != NaN in the comparison below
        ctx.block_step[2] = 0  # the row that is not live starts a block: still no block counted
        if seed < 2:  # live rows on the bound of "blocks_decoded" (0 counts, 1 does not) and of
            ctx.block_step[:2] = torch.tensor([0, 1])  # "post_forwards_with_edit" (row 1 in a post step:
            # one edit, or none)
            ctx.edit[1] = ctx.valid[1] & (torch.arange(8) == int(ctx.valid[1].nonzero()[0, 0])) if seed else False
        before = state.counts.clone(), state.block_masked.clone(), state.block_step.clone()
        write_step(state, ctx, no_remask=no_remask)
        results.append([t.tolist() for t in (state.canvas, state.written_step, state.written_conf, state.counts,
                                             state.block_masked, state.block_step)])
    assert results[0] == results[1]
    # the counter row by hand, from the context's selections (the non-live row 2 counts nothing,
    # although its block_step may be 0: the near miss of "blocks_decoded")
    counts0, masked0, step0 = before
    for r in range(3):
        live = bool(ctx.live[r])
        c, e, m = (int(getattr(ctx, k)[r].sum()) for k in ("commit", "edit", "remask"))
        post = bool(ctx.post[r])
        want = [live, c, e, m, c >= 2, post, post and e > 0, live and int(ctx.block_step[r]) == 0, 0, 0, 0]
        got = [a - b for a, b in zip(results[0][3][r], counts0[r].tolist())]
        assert got == [int(x) for x in want], dict(zip(COUNTERS, got))
        assert results[0][4][r] == int(masked0[r]) - (c - m)
        assert results[0][5][r] == int(step0[r]) + live


def test_a_window_before_position_zero_writes_each_position_once_with_its_own_value():
    """Slots clamped onto position 0 carry the value of the slot that holds position 0: the scatter
    of the loop's context writes what the row path writes."""
    out = []
    for rows in ("own", "copy"):
        state, ctx, _ = a_step(1, rows)
        ctx.positions = ctx.positions - ctx.positions[:, :1] - 3  # windows [-3, 5)
        ctx.commit = torch.zeros(3, 8, dtype=torch.bool)
        ctx.commit[:, 3:] = True
        ctx.edit = ctx.remask = torch.zeros(3, 8, dtype=torch.bool)
        ctx.sampled = torch.arange(24).view(3, 8) + 10
        write_step(state, ctx)
        out.append(state.canvas[:, :5].tolist())
    assert out[0] == out[1] == [[13, 14, 15, 16, 17], [21, 22, 23, 24, 25], [29, 30, 31, 32, 33]]


def test_set_many_keeps_the_hits_until_the_read_and_the_first_hit_of_each_row():
    a, b = DeviceFlag("a", lambda hit: f"a row {hit.row} step {hit.step}"), DeviceFlag("b", lambda hit: f"b row {hit.row}")
    board = FlagBoard(FlagTable([("hook 'x'", a), ("hook 'x'", b)]), 2, torch.device("cpu"))
    board.step = 4
    hits = torch.tensor([[False, False], [True, False]])
    board.set_many([a, b], hits)
    assert board.slabs["a+b"] is hits and board.fresh == {"a+b": 5}
    host = torch.cat(board.pending()).tolist()
    assert host == [0, 0, 1, 0]
    with pytest.raises(StrategyError, match=r"^a row 1 step 4$"):
        board.raise_first(host, None)
    # set again before a read: row 1 keeps its first hit (step 4), row 0's is step 5
    board.step = 5
    board.set_many([a, b], torch.tensor([[True, False], [True, True]]))
    assert board.slabs["a+b"].tolist() == [[6, 0], [5, 6]] and board.fresh == {}
    # a read that found nothing drops the slab of hits as set; the next set starts afresh
    board.slabs["a+b"] = torch.zeros(2, 2, dtype=torch.bool)
    board.fresh["a+b"] = 6
    board.raise_first([0, 0, 0, 0], None)
    board.consumed()
    assert "a+b" not in board.slabs and board.fresh == {}
    board.step = 7
    board.set_many([a, b], torch.tensor([[False, True], [False, False]]))
    with pytest.raises(StrategyError, match=r"^b row 0$"):
        board.raise_first(torch.cat(board.pending()).tolist(), None)
    assert board.fresh == {"a+b": 8}


def test_pending_payload_of_flags_set_together_is_empty():
    state, ctx, pol = a_step(2)
    StepChecks(pol, 30).add(ctx, state)
    assert tuple(pending_payload(state, CHECKS[0]).shape) == (3, 0)
    state.flags.consumed()
    assert tuple(pending_payload(state, CHECKS[0]).shape) == (3, 0)


def decode_recording(model, prompts, reuse: bool, monkeypatch) -> tuple[object, list[tuple]]:
    """Decode, recording every model forward's inputs; ``reuse=False`` switches the layout reuse off."""
    calls: list[tuple] = []
    inner = model.forward_window

    def record(ids, pos, allowed, cache=None, cache_rows=None, cache_write=None):
        calls.append((ids.clone(), pos.clone(), allowed, allowed.clone(),
                      None if cache_write is None else cache_write.clone(), cache_rows))
        return inner(ids, pos, allowed, cache=cache, cache_rows=cache_rows, cache_write=cache_write)

    init = engine_module.StepEngine.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not reuse:
            self.reuse = False

    monkeypatch.setattr(engine_module.StepEngine, "__init__", patched)
    model.forward_window = record
    try:
        result = decode(model, prompts, policy(**{"blocks.params.eos_early_stop": True}), 40, kv_cache=True,
                        capture="eager")
    finally:
        del model.forward_window
        monkeypatch.setattr(engine_module.StepEngine, "__init__", init)
    return result, calls


def test_the_reused_layout_is_the_layout_built_every_step(monkeypatch):
    model = tiny_llada2(seed=3)
    prompts = [[5, 6, 7], [8] * 12, [9] * 5]
    runs = [decode_recording(model, prompts, reuse, monkeypatch) for reuse in (True, False)]
    (fast, fast_calls), (plain, plain_calls) = runs
    assert fast.tokens == plain.tokens and fast.forward_calls == plain.forward_calls
    assert [r.nfe for r in fast.rows] == [r.nfe for r in plain.rows]
    assert [r.forward_tokens for r in fast.rows] == [r.forward_tokens for r in plain.rows]
    assert len(fast_calls) == len(plain_calls)
    for f, p in zip(fast_calls, plain_calls):
        for k in (0, 1, 3, 4):
            assert (f[k] is None and p[k] is None) or torch.equal(f[k], p[k])
    # the reuse did happen (the very mask object of the step before), and never without it
    same = [a[2] is b[2] for a, b in zip(fast_calls, fast_calls[1:])]
    assert any(same) and not any(a[2] is b[2] for a, b in zip(plain_calls, plain_calls[1:]))


def decode_counting(model, prompts, pol, known: bool, check_every: int, monkeypatch) -> tuple[object, list[int]]:
    """Decode counting ``advance_blocks`` calls; ``known=False`` hands the schedule facts without the
    post bound or ``post_any`` (the general path: ``prepare`` always checks every row against
    ``max_post_steps``, ``finish_step`` always looks for converged rows)."""
    calls = [0, 0]  # every call, calls with at least one ending row
    advance = DecodeState.advance_blocks
    prepare, finish_step = SemiAutoregressive.prepare, SemiAutoregressive.finish_step

    def counted(self, ending, eos_early_stop):
        calls[0] += 1
        calls[1] += bool(ending.any())
        return advance(self, ending, eos_early_stop)

    monkeypatch.setattr(DecodeState, "advance_blocks", counted)
    if not known:
        monkeypatch.setattr(SemiAutoregressive, "prepare", lambda self, state, facts: prepare(self, state, UNKNOWN))
        monkeypatch.setattr(SemiAutoregressive, "finish_step",
                            lambda self, state, ctx, facts: finish_step(self, state, ctx, UNKNOWN))
    try:
        result = decode(model, prompts, pol, 40, kv_cache=True, capture="eager", check_every=check_every)
    finally:
        monkeypatch.setattr(DecodeState, "advance_blocks", advance)
        monkeypatch.setattr(SemiAutoregressive, "prepare", prepare)
        monkeypatch.setattr(SemiAutoregressive, "finish_step", finish_step)
    return result, calls


@pytest.mark.parametrize("max_post", [0, 1, 2, 16])
@pytest.mark.parametrize("check_every", [1, 3])
def test_block_schedule_without_advance_under_the_read_post_facts_matches_the_general_path(max_post, check_every, monkeypatch):
    model = tiny_llada2(seed=5)
    prompts = [[5, 6, 7], [8] * 12, [9] * 5]
    # edits keep blocks in post steps (the near-miss: a row goes past max_post_steps)
    pol = policy(**{"blocks.params.max_post_steps": max_post, "blocks.params.eos_early_stop": True})
    (fast, fast_calls), (plain, plain_calls) = (
        decode_counting(model, prompts, pol, known, check_every, monkeypatch) for known in (True, False))
    assert fast.tokens == plain.tokens and fast.forward_calls == plain.forward_calls
    for f, p in zip(fast.rows, plain.rows):
        assert (f.nfe, f.forward_tokens, f.post_forwards, f.blocks_decoded, f.eos_stopped) == (
            p.nfe, p.forward_tokens, p.post_forwards, p.blocks_decoded, p.eos_stopped)
    assert fast_calls[1] == plain_calls[1]  # the same blocks ended, by the same calls
    steps = max(r.nfe for r in plain.rows)
    assert plain_calls[0] >= 2 * steps  # the general path: prepare and finish_step every step
    if max_post == 16 and check_every == 1:  # the bound holds every step and every step is read: only
        # prepare's calls are gone, and finish_step's call is left only on steps that began a post step
        assert 0 < fast_calls[0] <= sum(r.post_forwards for r in plain.rows) < steps


def a_written_step(width: int, last_block: int | None) -> tuple[DecodeState, object]:
    """A valid step of three rows (row 2 not live) on a window of ``width`` slots ending at each
    row's block end; ``last_block``: row 2's active block (its window may pass the canvas end)."""
    g = torch.Generator().manual_seed(width * 7 + (last_block or 0))
    pol = policy()
    state = DecodeState.start([[1, 2, 3], [4] * 11, [5] * 6], 20, pol.blocks, MASK, EOS, VOCAB, 0)
    state.canvas = torch.where(torch.rand(state.canvas.shape, generator=g) < 0.5,
                               torch.randint(0, 90, state.canvas.shape, generator=g), state.canvas)
    state.written_conf = torch.rand(state.canvas.shape, generator=g)
    if last_block is not None:
        state.block[2] = last_block
    live = torch.tensor([True, True, False])
    lo, hi = pol.blocks.window(state, state.all_rows)
    ctx = step_context(pol, state, live, lo, hi, torch.randn(3, width, VOCAB, generator=g))
    ctx.commit = (torch.rand(3, width, generator=g) < 0.4) & ctx.valid
    ctx.edit = (torch.rand(3, width, generator=g) < 0.3) & ctx.valid & ~ctx.commit
    ctx.remask = (torch.rand(3, width, generator=g) < 0.2) & ctx.valid & ~(ctx.commit | ctx.edit)
    ctx.confidence = ctx.confidence.nan_to_num(0.5)
    return state, ctx


@pytest.mark.parametrize("width, last_block, inside", [
    (8, None, True),  # min hi == W: the window of rows 0 and 2 starts at position 0
    (9, None, False),  # near miss: it starts at -1 (a slot clamps onto position 0)
    (8, 3, True),  # row 2's window ends at the canvas end (hi == Lmax == 32)
    (8, 4, False),  # near miss: it ends past it (slots clamp onto position 31)
])
def test_write_step_inside_the_canvas_matches_the_general_write(width, last_block, inside, monkeypatch):
    from dlm_toolkit.step import canvas as canvas_module
    out, slots_calls = [], []
    for hint in (True, False):
        state, ctx = a_written_step(width, last_block)
        old = [t.clone() for t in (state.canvas, state.written_step, state.written_conf)]
        his = (ctx.positions[:, -1] + 1).tolist()
        assert state.canvas.shape[1] == 32 and (min(his) >= width and max(his) <= 32) == inside
        facts = StepFacts(read=True, window_ends=(min(his), max(his))) if hint else StepFacts(read=True)
        calls = [0]
        slots = canvas_module.window_slots

        def counted(*args, **kwargs):
            calls[0] += 1
            return slots(*args, **kwargs)

        monkeypatch.setattr(canvas_module, "window_slots", counted)
        write_step(state, ctx, facts)
        monkeypatch.setattr(canvas_module, "window_slots", slots)
        assert facts.later().window_ends is None  # a later step without a read takes the general path
        slots_calls.append(calls[0])
        out.append([t.tolist() for t in (state.canvas, state.written_step, state.written_conf, state.counts)])
    assert out[0] == out[1]
    assert slots_calls == [0 if inside else 1, 1]
    # a plain reference: each slot on the canvas writes its own value, the rest keep theirs
    canvas, wstep, wconf = (t.tolist() for t in old)
    for r in range(3):
        for j, pos in enumerate(ctx.positions[r].tolist()):
            if not 0 <= pos < 32:
                continue
            wrote = bool(ctx.commit[r, j] or ctx.edit[r, j])
            if wrote:
                canvas[r][pos], wstep[r][pos] = int(ctx.sampled[r, j]), int(state.nfe[r]) - int(ctx.live[r])
                wconf[r][pos] = float(ctx.confidence[r, j])
            if ctx.remask[r, j]:
                canvas[r][pos], wstep[r][pos], wconf[r][pos] = MASK, -1, 0.0
    assert out[0][:3] == [canvas, wstep, wconf]


def test_the_decode_loop_writes_inside_the_canvas_without_window_slots(monkeypatch):
    from dlm_toolkit.step import canvas as canvas_module
    model = tiny_llada2(seed=3)
    prompts = [[5, 6, 7], [8] * 12, [9] * 5]
    out, calls = [], [0]
    slots = canvas_module.window_slots

    def counted(*args, **kwargs):
        calls[0] += 1
        return slots(*args, **kwargs)

    monkeypatch.setattr(canvas_module, "window_slots", counted)
    for check_every in (1, 2):  # the read every step (layout reuse: window ends read) / not every step
        calls[0] = 0
        res = decode(model, prompts, policy(), 40, kv_cache=True, capture="eager", check_every=check_every)
        out.append((res.tokens, [r.nfe for r in res.rows], calls[0], max(r.nfe for r in res.rows)))
    (fast_tokens, fast_nfe, fast_calls, steps), (tokens, nfe, plain_calls, _) = out
    assert fast_tokens == tokens and fast_nfe == nfe
    assert plain_calls >= steps  # no read of the window ends: the general write every step
    assert fast_calls < steps  # read every step: some steps wrote without window_slots


def test_the_counts_views_follow_a_replaced_counts_tensor():
    """``counts_columns`` and ``nfe`` are views made once per ``counts`` tensor: writes through them
    land in ``counts``, and a new ``counts`` tensor gets new views (not the old tensor's)."""
    state, _, _ = a_step(0)
    state.counts.zero_()
    state.counts_columns(0, 1).add_(1)
    state.nfe.add_(1)
    assert state.counts[:, 0].tolist() == [2, 2, 2] and state.counts[:, 1:].abs().sum() == 0
    state.counts = torch.zeros_like(state.counts)
    state.counts_columns(1, 2).add_(5)
    state.nfe.add_(3)
    assert state.counts[0].tolist() == [3, 5, 5] + [0] * (state.counts.shape[1] - 3)


def test_prepare_and_advance_blocks_on_their_bounds():
    """semi_ar's prepare by hand on rows on each bound: a live row with no mask gets a post step, one
    mask (near miss) or a done row does not; past max_post_steps a row moves to its next block (post
    and block_step reset, the new block's masks counted) or, from its last block, is done (its
    counters left as they were); a row done earlier stays as it is."""
    pol = policy(**{"blocks.params.block_length": 4, "blocks.params.max_post_steps": 1,
                    "blocks.params.eos_early_stop": False, "blocks.params.align": "prompt"})
    state = DecodeState.start([[1, 2]] * 5, 8, pol.blocks, MASK, EOS, VOCAB, 0)  # two blocks per row
    state.block[:] = torch.tensor([0, 0, 2, 0, 1])
    state.done[:] = torch.tensor([False, False, True, False, False])
    state.block_masked[:] = torch.tensor([0, 1, 0, 0, 0])
    state.post[:] = torch.tensor([0, 0, 0, 1, 1])
    state.block_step[:] = 5
    state.canvas[3, 2 + 4] = 7  # row 3's next block holds one token: 3 masks
    live = pol.blocks.prepare(state)
    assert live.tolist() == [True, True, False, True, False]
    assert state.done.tolist() == [False, False, True, False, True]
    assert state.block.tolist() == [0, 0, 2, 1, 2]
    assert state.post.tolist() == [1, 0, 0, 0, 2]
    assert state.block_step.tolist() == [5, 5, 5, 0, 5]
    assert state.block_masked.tolist() == [0, 1, 0, 3, 0]
    assert state.block_masked_start[3] == 3
