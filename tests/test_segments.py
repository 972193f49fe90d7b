"""The engine's forward primitive (:mod:`dlm_toolkit.step.segments`, ``StepEngine.run``) and the canvas
module (:mod:`dlm_toolkit.step.canvas`), driven by toy hooks written only against the public API:

- a hook appends a segment to every step forward (a copy of the window's generated slots, hidden
  from everything but the prompt, or from everything but its block with or without the key at its
  own position) and reads its logits; each is checked against a plain full-sequence forward of the
  model over the same ids and positions with an attention mask built here, entry by entry;
- counters: an appended segment adds ``forward_tokens`` and no NFE; a hook's own forward
  (``extra_forward``) adds an NFE to its rows only;
- a hook that rewrites the canvas through :mod:`dlm_toolkit.step.canvas` only.
"""

from __future__ import annotations

import pytest
import torch

from dlm_toolkit import T2T, DecodingPolicy, decode
from dlm_toolkit.step.canvas import window_values, write_window
from dlm_toolkit.hooks import Declaration, StepHook
from dlm_toolkit.step.segments import Keys, Segment
from dlm_toolkit.testing import tiny_llada2
from strategies.t2t_none import NoEdit

BL = 4
P = 8  # both prompts are two whole blocks: the generation starts at block 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 3, 21, 4, 22, 5, 23, 6]]
GEN = 8


def policy(t2t: str = "none", m2t: dict | None = None) -> DecodingPolicy:
    # threshold 1.0: never above, so every step commits exactly one mask (the fallback): 4 steps a block
    m2t = m2t or {"name": "threshold", "params": {"threshold": 1.0}}
    return DecodingPolicy({"m2t": m2t, "t2t": {"name": t2t}, "remask": {"name": "none"},
                           "blocks": {"name": "semi_ar", "params": {"block_length": BL, "max_post_steps": 0,
                                                                    "eos_early_stop": False}}})


def registered(cls: type, name: str) -> str:
    if name not in T2T.names():
        T2T.register(name)(cls)
    return name


class CopyHook(StepHook):
    """Appends a copy of the window's generated slots (same ids, same positions) to every step
    forward. ``mode`` "prompt": a copy query sees the prompt and itself only (its group is the
    prompt's last block, it sees no other copy slot); "block": it sees what a window query of its
    block sees, and ``hide`` hides the window key at its own position. Records, per step, the
    canvas, the copy's positions / real slots and its logits (test instrumentation)."""

    def __init__(self, mode: str, hide: bool = False):
        self.mode, self.hide, self.records = mode, hide, []

    def step_segments(self, engine, state, live, window):
        real = window.real & (window.pos >= P)
        group = torch.full_like(window.pos, P // BL - 1) if self.mode == "prompt" else window.group
        self.records.append({"canvas": state.canvas.clone(), "pos": window.pos.clone(), "real": real})
        return [Segment(window.ids, window.pos, real, group, see_primary=Keys.UP_TO, see_self=Keys.NONE,
                        hide_own_position=self.hide)]

    def after_forward(self, ctx, engine, state):
        (logits,) = engine.segment_logits(self)
        self.records[-1]["logits"] = logits.clone()


HOOK: list[StepHook] = []  # the hook the next policy's rule hands out


class WithHook(NoEdit):
    def step_hooks(self, policy, role):
        return list(HOOK)


def run(hook: StepHook, kv_cache: bool, model=None, m2t: dict | None = None):
    HOOK[:] = [hook]
    model = model or tiny_llada2(seed=3)
    return decode(model, PROMPTS, policy(registered(WithHook, "_segment_hook"), m2t), GEN, kv_cache=kv_cache,
                  capture="eager")


def reference(model, canvas: list[int], slots: list[int], visible) -> torch.Tensor:
    """Logits of copy slots at ``slots`` from one plain forward over ``canvas ++ [canvas[p] for p in
    slots]`` at positions ``0..H-1 ++ slots``: the canvas part block-causal, copy query ``p`` the
    canvas keys ``k`` with ``visible(p, k)`` and itself."""
    h, c = len(canvas), len(slots)
    ids = torch.tensor([canvas + [canvas[p] for p in slots]])
    pos = torch.tensor([list(range(h)) + slots])
    attn = torch.zeros(h + c, h + c, dtype=torch.bool)
    for q in range(h + c):
        for k in range(h + c):
            if q < h:
                attn[q, k] = k < h and k // BL <= q // BL
            else:
                attn[q, k] = (k < h and visible(slots[q - h], k)) or k == q
    with torch.inference_mode():
        return model(ids, pos, attn[None])[0, h:]


def check_against_reference(hook: CopyHook, model, visible) -> int:
    checked = 0
    for rec in hook.records:
        for r in range(len(PROMPTS)):
            slots = [int(p) for p, x in zip(rec["pos"][r], rec["real"][r]) if x]
            if not slots:
                continue
            hi = (max(slots) // BL + 1) * BL
            want = reference(model, rec["canvas"][r, :hi].tolist(), slots, visible)
            got = rec["logits"][r][rec["real"][r]]
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
            checked += len(slots)
    return checked


@pytest.mark.parametrize("kv_cache", [True, False])
def test_a_segment_that_sees_only_the_prompt_gets_the_logits_of_a_plain_forward(kv_cache):
    model = tiny_llada2(seed=3)
    hook = CopyHook("prompt")
    run(hook, kv_cache, model)
    assert check_against_reference(hook, model, lambda p, k: k < P) > 0
    # near miss: a reference that lets the copy see its own block too disagrees
    with pytest.raises(AssertionError):
        check_against_reference(hook, model, lambda p, k: k // BL <= p // BL)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_hiding_the_own_position_is_exactly_that_key(kv_cache):
    model = tiny_llada2(seed=3)
    hidden, shown = CopyHook("block", hide=True), CopyHook("block", hide=False)
    run(hidden, kv_cache, model)
    run(shown, kv_cache, model)
    assert check_against_reference(hidden, model, lambda p, k: k // BL <= p // BL and k != p) > 0
    assert check_against_reference(shown, model, lambda p, k: k // BL <= p // BL) > 0
    with pytest.raises(AssertionError):  # near miss: the hidden copy is not the one that sees its position
        check_against_reference(hidden, model, lambda p, k: k // BL <= p // BL)


@pytest.mark.parametrize("kv_cache, extra", [(True, 4 * 4 + 8 + 3 * 4), (False, 4 * 4 + 4 * 8)])
def test_a_segment_adds_forward_tokens_and_no_nfe(kv_cache, extra):
    # 4 steps a block, 2 blocks; each step's copy holds the window's generated real slots: with the
    # cache the active block (4), except the first step of the second block, whose span also holds
    # the first block as it enters the cache (8); without it every generated position up to the
    # block's end (4, then 8)
    model = tiny_llada2(seed=3)
    plain = decode(model, PROMPTS, policy(), GEN, kv_cache=kv_cache, capture="eager")
    hooked = run(CopyHook("prompt"), kv_cache, model)
    assert hooked.tokens == plain.tokens
    assert hooked.forward_calls == plain.forward_calls
    for a, b in zip(hooked.rows, plain.rows):
        assert a.nfe == b.nfe == 8
        assert a.forward_tokens - b.forward_tokens == extra


class ExtraForward(StepHook):
    """After the rules, one forward of its own for batch row 0: a copy of the window (hidden from
    nothing but itself and the cache), through the engine's documented extra forward."""

    def declare(self, policy):
        return Declaration(forward_budget=policy.blocks.block_length)  # one extra forward per step of a block

    def after_rules(self, ctx, engine, state):
        rows = ctx.live & (ctx.rows == 0)
        pos = ctx.positions.clamp(0, state.canvas.shape[1] - 1)
        seg = Segment(ctx.tokens, pos, rows[:, None] & ctx.valid, engine.groups(pos))
        engine.extra_forward([seg], rows)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_an_extra_forward_adds_nfe_to_its_rows_only(kv_cache):
    model = tiny_llada2(seed=3)
    plain = decode(model, PROMPTS, policy(), GEN, kv_cache=kv_cache, capture="eager")
    hooked = run(ExtraForward(), kv_cache, model)
    assert hooked.tokens == plain.tokens  # the threshold rule does not read block_step
    assert [r.nfe for r in hooked.rows] == [16, 8] and [r.nfe for r in plain.rows] == [8, 8]
    assert hooked.forward_calls == plain.forward_calls + 8
    # row 0's extra forwards hold its window's 4 valid slots each (8 steps); row 1's nothing
    assert [a.forward_tokens - b.forward_tokens for a, b in zip(hooked.rows, plain.rows)] == [32, 0]


class PinFive(StepHook):
    """After the write, every written generated token of the window becomes token 5 (provenance
    kept), written only through dlm_toolkit.step.canvas."""

    def after_write(self, ctx, state):
        tokens, step, conf = window_values(state, ctx)
        pinned = (tokens != state.mask_token_id) & ctx.valid & ~ctx.is_prompt
        write_window(state, ctx, torch.where(pinned, 5, tokens), step, conf)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_a_hook_writes_the_canvas_through_the_canvas_module(kv_cache):
    model = tiny_llada2(seed=3)
    plain = decode(model, PROMPTS, policy(), GEN, kv_cache=kv_cache, capture="eager")
    pinned = run(PinFive(), kv_cache, model)
    assert all(t == [5] * GEN for t in pinned.tokens)
    assert any(t != [5] * GEN for t in plain.tokens)  # near miss: without the hook the model writes others
    assert [r.nfe for r in pinned.rows] == [8, 8]  # one commit a step: the pins kept block_masked right
    for r, p in enumerate(PROMPTS):
        assert pinned.canvas[r, :P].tolist() == p  # the prompt is never a target


@pytest.mark.parametrize("start, want", [(-2, [92, 93, 12, 13]), (2, [10, 11, 90, 91]), (0, [90, 91, 92, 93])])
def test_window_slots_off_the_canvas_carry_the_value_of_the_position_they_clamp_onto(start, want):
    # canvas [10, 11, 12, 13]; window of 4 slots at start..start+3 drafted as [90, 91, 92, 93]: a slot
    # left of 0 clamps onto 0 and writes the value of the slot at 0; right of 3 onto 3 likewise
    from dlm_toolkit.step.canvas import drafted_canvas, window_slots
    from dlm_toolkit.testing import make_context

    ctx = make_context(torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, 4, 8), mask_token_id=7)
    ctx.positions = ctx.positions + start
    canvas = torch.tensor([[10, 11, 12, 13]])
    assert drafted_canvas(canvas, ctx, torch.tensor([[90, 91, 92, 93]])).tolist() == [want]
    assert canvas.tolist() == [[10, 11, 12, 13]]  # a copy: the canvas itself is untouched
    at_pos, same = window_slots(ctx, 4)
    assert at_pos.tolist() == [[min(max(start + j, 0), 3) for j in range(4)]]
    assert same.tolist() == [[min(max(start + j, 0), 3) - start for j in range(4)]]


class BadSegment(StepHook):
    """Appends a segment whose ``real`` is a long tensor (a bool one is the near miss: CopyHook)."""

    name = "hook 'bad_segment'"

    def step_segments(self, engine, state, live, window):
        return [Segment(window.ids, window.pos, window.real.long(), window.group)]


class BadRows(StepHook):
    name = "hook 'bad_rows'"

    def after_rules(self, ctx, engine, state):
        engine.extra_forward([Segment(ctx.tokens, ctx.positions.clamp(min=0), ctx.valid, engine.groups(
            ctx.positions.clamp(min=0)))], ctx.live.long())


def test_a_malformed_segment_or_rows_is_one_error_naming_the_hook_and_field():
    from dlm_toolkit import StrategyError

    with pytest.raises(StrategyError, match=r"^hook 'bad_segment' \(step_segments\): segment field 'real' must be a "
                                            r"torch.bool tensor of shape \(2, 4\) \(like 'ids'\), got torch.int64"):
        run(BadSegment(), True)
    with pytest.raises(StrategyError, match=r"^extra_forward: rows must be a bool tensor of shape \(2,\), got "
                                            r"torch.int64"):
        run(BadRows(), True)


@pytest.mark.parametrize("align", ["absolute", "prompt"])
def test_the_engines_window_pattern_without_the_cache_is_its_rule(align):
    # the engine's one-comparison pattern of the cache-off window (StepEngine.prefix_pattern) against
    # the generic rule (keys of the query's group or earlier, real slots only) on random window ends and
    # live rows; align "prompt" puts positions before the origin in group -1
    from dlm_toolkit.decoding.engine import StepEngine
    from dlm_toolkit.step.segments import layout
    from dlm_toolkit.step.state import DecodeState

    pol = DecodingPolicy({"m2t": {"name": "threshold"}, "t2t": {"name": "none"}, "remask": {"name": "none"},
                          "blocks": {"name": "semi_ar", "params": {"block_length": BL, "align": align}}})
    prompts = [[1] * 3, [2] * 6, [3] * 9]
    state = DecodeState.start(prompts, 10, pol.blocks, 63, 62, 64, [0, 1, 2], torch.device("cpu"))
    engine = StepEngine(tiny_llada2(), pol.blocks, state, cached=False, mode="eager", backend="inductor")
    n, length = state.canvas.shape
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(20):
        hi = torch.randint(1, length + 1, (n,), generator=gen)
        live = torch.rand(n, generator=gen) < 0.8
        width = int(torch.randint(1, length + 1, (), generator=gen))
        pos = torch.arange(width).expand(n, -1)
        real = live[:, None] & (pos < hi[:, None])
        group = engine.groups(pos)
        rule = layout([Segment(pos, pos, real, group)], torch.zeros(width, width, dtype=torch.bool))[2]
        assert torch.equal(engine.prefix_pattern(pos, real, hi, group), rule)
        checked += int(rule.sum())
    assert checked > 0
