"""Device flags (dlm_toolkit.step.flags): a toy plug-in hook written only against the public API declares
a flag and sets it on the device; the engine's one host read raises it naming the right row, at the
right read, with the row's first payload. Plus the table's refusals (name collisions, wrong dtype or
shape) and the hook combinations refused when the policy is built (dlm_toolkit.hooks).

Expected values are worked out by hand (which read follows which step, which row and payload wins),
never read from the engine."""

from __future__ import annotations

import itertools

import pytest
import torch

from dlm_toolkit import M2T, T2T, ConfigError, DecodingPolicy, Selection, StrategyError, decode
from dlm_toolkit.hooks.dynamic_blocks import DynamicBlocksHook
from dlm_toolkit.step.flags import DeviceFlag, FlagBoard, FlagTable, set_flag
from dlm_toolkit.hooks import Declaration, StepHook
from dlm_toolkit.testing import ScriptedLM, table_logits
from strategies.m2t_threshold import ThresholdUnmask
from strategies.t2t_none import NoEdit

V, MASK, EOS = 12, 11, 10
_names = itertools.count()


def flat_table() -> torch.Tensor:
    table = torch.randn(64, V, generator=torch.Generator().manual_seed(0)) * 3
    table[:, MASK] = -torch.inf
    table[:, EOS] = -9.0  # no EOS: every row runs all its steps
    return table


def model() -> ScriptedLM:
    return ScriptedLM(table_logits(flat_table()), V, MASK, EOS)


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]  # a batch of 3


def _row_message(hit) -> str:
    return f"{hit.owner}: toy flag in batch row {hit.row}, set at step {hit.payload[0]} (tag {hit.payload[1]})"


class RowFlag(StepHook):
    """Sets its flag after the write in row ``r`` at every step ``>= at[r]``, with payload
    ``(step, 10 * step + row)``. Counts nothing, reads nothing back to the host."""

    def __init__(self, at: dict[int, int], flag_name: str = "toy_row_flag", hit_dtype=torch.bool,
                 payload_width: int = 2, declares: bool = True):
        self.at, self.hit_dtype, self.payload_width, self.declares = at, hit_dtype, payload_width, declares
        self.name = "hook 'row_flag'"
        self.flag = DeviceFlag(flag_name, _row_message, payload=2)

    def declare(self, policy):
        return Declaration(flags=[self.flag] if self.declares else [])

    def after_write(self, ctx, state):
        rows = torch.arange(state.batch_size, device=state.device)
        hit = torch.zeros_like(ctx.live)
        for r, at in self.at.items():
            hit = hit | ((rows == r) & (ctx.step >= at))
        payload = torch.stack([ctx.step, 10 * ctx.step + rows], 1)[:, :self.payload_width]
        set_flag(state, self.flag, (hit & ctx.live).to(self.hit_dtype), payload)


class Plain(StepHook):
    name = "hook 'plain'"


class Mover(StepHook):
    name = "hook 'mover'"

    def declare(self, policy):
        return Declaration(moves_block=True)


class Fixed(StepHook):
    name = "hook 'fixed'"

    def declare(self, policy):
        return Declaration(needs_fixed_block="a toy block copy")


def asking(*hooks: StepHook, base: type = NoEdit) -> str:
    """The name of a new T2T rule (``base`` otherwise) whose ``step_hooks`` gives ``hooks``."""
    name = f"_flags_asks_{next(_names)}"
    T2T.register(name)(type("Asks", (base,), {"step_hooks": lambda self, policy, role: list(hooks)}))
    return name


def with_hooks(*hooks: StepHook, blocks: str = "semi_ar", m2t: str = "threshold") -> DecodingPolicy:
    """A policy whose T2T rule (no edits) asks for ``hooks``; one commit per step (threshold 1.0:
    only the fallback commit)."""
    name = asking(*hooks)
    params = {"block_length": 4, "max_block_length": 4} if blocks == "dsb" else {"block_length": 4}
    return DecodingPolicy({"m2t": {"name": m2t, "params": {"threshold": 1.0}}, "t2t": {"name": name},
                           "blocks": {"name": blocks, "params": params}})


# -- the toy flag through a real decode ----------------------------------------------------------------
@pytest.mark.parametrize("check_every, forwards", [(1, 5), (3, 6)])
def test_a_plugin_flag_raises_naming_its_row_at_the_read_after_its_step(check_every, forwards):
    """Row 2 of 3 sets the flag from step 4 on. The read after step 4 comes before forward 6 with
    ``check_every=1`` (5 forwards ran), and before forward 7 with ``check_every=3`` (reads before steps
    0, 3, 6: 6 forwards ran, row 2 set it at steps 4 and 5: the first payload wins). Fails when the
    flag is left out of the read's concatenation (no error), when the payload slice is off by one
    (the step would read 5 or the tag 4), when the row is mis-decoded, and when the last hit wins."""
    m = model()
    with pytest.raises(StrategyError, match=r"^hook 'row_flag': toy flag in batch row 2, set at step 4 \(tag 42\)$"):
        decode(m, PROMPTS, with_hooks(RowFlag({2: 4})), 16, kv_cache=False, check_every=check_every)
    assert m.calls == forwards


def test_the_earliest_hit_wins_across_rows_and_the_lowest_row_on_a_tie():
    """Row 2 from step 4, row 1 from step 5, read after step 5 (check_every=3): row 2 (earlier),
    although row 1 is lower. Near miss: both from step 4: row 1 (the lowest)."""
    with pytest.raises(StrategyError, match=r"batch row 2, set at step 4 \(tag 42\)$"):
        decode(model(), PROMPTS, with_hooks(RowFlag({2: 4, 1: 5})), 16, kv_cache=False, check_every=3)
    with pytest.raises(StrategyError, match=r"batch row 1, set at step 4 \(tag 41\)$"):
        decode(model(), PROMPTS, with_hooks(RowFlag({2: 4, 1: 4})), 16, kv_cache=False, check_every=3)


def test_a_flag_never_set_costs_no_error_and_changes_no_token():
    """Declared but never set (step 999 never comes): the decode gives the tokens and NFE of the same
    policy without the hook."""
    got = decode(model(), PROMPTS, with_hooks(RowFlag({2: 999})), 16, kv_cache=False, check_every=2)
    plain = decode(model(), PROMPTS, with_hooks(Plain()), 16, kv_cache=False, check_every=2)
    assert got.tokens == plain.tokens and [r.nfe for r in got.rows] == [r.nfe for r in plain.rows]
    assert all(len(t) == 16 for t in got.tokens)


@pytest.mark.parametrize("hook, what", [
    (RowFlag({2: 0}, hit_dtype=torch.long), r"must be set with a bool tensor of shape \(3,\).*got torch.int64"),
    (RowFlag({2: 0}, payload_width=1), r"must be set with a long payload of shape \(3, 2\).*shape \(3, 1\)"),
])
def test_a_flag_set_with_the_wrong_dtype_or_shape_is_refused_at_once_naming_the_hook(hook, what):
    """Metadata only: refused in the first step (one forward), not at a later read."""
    m = model()
    with pytest.raises(StrategyError, match=rf"^hook 'row_flag': device flag 'toy_row_flag' {what}"):
        decode(m, PROMPTS, with_hooks(hook), 16, kv_cache=False, check_every=4)
    assert m.calls == 1


def test_a_flag_no_hook_declares_is_refused():
    with pytest.raises(StrategyError, match="device flag 'toy_row_flag' was set but no hook of the policy declares it"):
        decode(model(), PROMPTS, with_hooks(RowFlag({2: 0}, declares=False)), 16, kv_cache=False)


class _Recommits(ThresholdUnmask):
    """Also selects the rightmost written generated position of the window (not fillable)."""

    def __call__(self, ctx):
        out = super().__call__(ctx)
        out = out.select if isinstance(out, Selection) else out
        written = (ctx.written_step >= 0) & ctx.valid & ~ctx.is_prompt
        last = torch.where(written, ctx.positions, -1).amax(1, keepdim=True)
        return out | (written & (ctx.positions == last))


def test_the_step_checks_keep_each_rows_first_failed_step():
    """Confidence falls with the position, one commit per step: step 0 writes 3 (block [0, 4), prompt
    [0, 3)), step 1 writes 4 (block [4, 8)); the rule re-selects 4 at step 2 and 5 at step 3, both
    before the read before step 4 (check_every=4): the message names the first, position 4. Fails
    when a later failure of the same check overwrites the row's first."""
    table = torch.zeros(64, V)
    table[:, 1] = 20.0 - torch.arange(64)  # token 1 at every position, less sure further right
    table[:, MASK] = -torch.inf
    name = f"_flags_recommits_{next(_names)}"
    M2T.register(name)(_Recommits)
    pol = DecodingPolicy({"m2t": {"name": name, "params": {"threshold": 1.0}},
                          "blocks": {"name": "semi_ar", "params": {"block_length": 4, "max_post_steps": 0,
                                                                   "eos_early_stop": False}}})
    m = ScriptedLM(table_logits(table), V, MASK, EOS)
    with pytest.raises(StrategyError, match=rf"^m2t rule '{name}' selected position 4 of batch row 0, which is not "
                                            "fillable"):
        decode(m, [[1, 2, 3]], pol, 12, kv_cache=False, check_every=4)
    assert m.calls == 4


# -- the table ----------------------------------------------------------------------------------------
def test_flag_names_colliding_are_refused_at_policy_build_naming_both_hooks():
    other = RowFlag({0: 0})
    other.name = "hook 'other'"
    with pytest.raises(ConfigError, match=r"^device flag 'toy_row_flag' is declared by hook 'row_flag' and by "
                                          r"hook 'other'"):
        with_hooks(RowFlag({2: 0}), other)
    with pytest.raises(ConfigError, match=r"device flag 'window_too_wide' is declared by hook 'row_flag' and by the "
                                          r"step engine"):
        with_hooks(RowFlag({2: 0}, flag_name="window_too_wide"))
    with pytest.raises(ConfigError, match=r"device flag 'm2t' is declared by the step checks and by hook 'row_flag'"):
        with_hooks(RowFlag({2: 0}, flag_name="m2t"))
    # near miss: distinct names
    other.flag = DeviceFlag("toy_other", _row_message, payload=2)
    pol = with_hooks(RowFlag({2: 0}), other)
    assert {"toy_row_flag", "toy_other", "m2t", "window_too_wide"} <= set(pol.flags.owners)


def test_device_flags_must_be_device_flag_objects():
    class Bad(Plain):
        def declare(self, policy):
            return Declaration(flags=["toy"])

    class NotAList(Plain):
        def declare(self, policy):
            return Declaration(flags=DeviceFlag("toy", _row_message))

    with pytest.raises(ConfigError, match=r"^hook 'plain': Declaration.flags must be a list of DeviceFlag "
                                          "objects, got str$"):
        with_hooks(Bad())
    with pytest.raises(ConfigError, match=r"^hook 'plain': Declaration.flags must be a list of DeviceFlag "
                                          "objects, got DeviceFlag$"):
        with_hooks(NotAList())
    assert "toy" in with_hooks(RowFlag({}, flag_name="toy")).flags.owners  # near miss: a list of one flag
    with pytest.raises(ConfigError, match=r"device flag 'x': payload must be an integer in \[0, 16\]"):
        DeviceFlag("x", _row_message, payload=17)
    assert DeviceFlag("x", _row_message, payload=16).payload == 16


def test_the_board_keeps_each_rows_first_hit_and_raises_the_earliest():
    """Hand-worked slab: column 0 is 1 + the step of the row's first hit, then its payload."""
    a = DeviceFlag("a", lambda hit: f"a row {hit.row} step {hit.step} payload {hit.payload}", payload=2)
    b = DeviceFlag("b", lambda hit: f"b row {hit.row} step {hit.step}")
    board = FlagBoard(FlagTable([("hook 'a'", a), ("hook 'b'", b)]), 3, torch.device("cpu"))
    board.set(b, torch.tensor([False, False, False]))
    board.step = 1
    board.set(a, torch.tensor([False, True, False]), torch.tensor([[1, 2], [3, 4], [5, 6]]))
    board.step = 2
    board.set(a, torch.tensor([True, True, False]), torch.tensor([[7, 8], [9, 10], [11, 12]]))
    board.set(b, torch.tensor([False, False, True]))
    host = torch.cat(board.pending()).tolist()
    assert host == [0, 0, 3] + [3, 7, 8, 2, 3, 4, 0, 0, 0]  # b's slab first: it was set first
    with pytest.raises(StrategyError, match=r"^a row 1 step 1 payload \(3, 4\)$"):
        board.raise_first(host, None)
    board.raise_first([0, 0, 0] + [0] * 9, None)  # nothing set: nothing raised
    # near miss: b hit as early as a: the table's order (a before b) decides; b earlier: b
    with pytest.raises(StrategyError, match=r"^a row 0"):
        board.raise_first([0, 0, 3] + [3, 7, 8, 0, 0, 0, 0, 0, 0], None)
    with pytest.raises(StrategyError, match=r"^b row 2 step 1$"):
        board.raise_first([0, 0, 2] + [3, 7, 8, 0, 0, 0, 0, 0, 0], None)


# -- hook combinations ------------------------------------------------------------------------------
@pytest.mark.parametrize("hooks", [(Fixed(), Mover()), (Mover(), Fixed())], ids=["fixed-first", "mover-first"])
def test_a_hook_needing_a_fixed_block_and_one_moving_it_are_refused_naming_both(hooks):
    with pytest.raises(ConfigError, match=r"^hook 'fixed' \(a toy block copy\) needs a fixed block layout; "
                                          r"hook 'mover' moves and resizes its block"):
        with_hooks(*hooks)


def test_compatible_hooks_are_accepted():
    """Near misses: a mover with a plain hook, a fixed-block hook on fixed blocks."""
    assert [type(h) for h in with_hooks(Mover(), Plain()).hooks] == [Mover, Plain]
    assert [type(h) for h in with_hooks(Fixed()).hooks] == [Fixed]


def test_dynamic_blocks_are_a_hook_refusing_fixed_block_hooks():
    pol = with_hooks(Plain(), blocks="dsb")
    assert [type(h) for h in pol.hooks] == [Plain, DynamicBlocksHook]
    assert pol.flags.owners["dynamic_bounds"] == "block schedule 'dsb'"
    with pytest.raises(ConfigError, match=r"^hook 'fixed' \(a toy block copy\) needs a fixed block layout; "
                                          r"block schedule 'dsb' moves and resizes its block"):
        with_hooks(Fixed(), blocks="dsb")


def test_the_shipped_fixed_block_hooks_are_refused_on_dynamic_blocks_naming_both():
    """The shadow block (a remask rule's) and the verification forward (an M2T rule's) on ``dsb``; near
    miss: the same rules on semi_ar."""
    for overrides, who in [({"remask.name": "wino_shadow"}, r"remask rule 'wino_shadow' \(a shadow block\)"),
                           ({"m2t.name": "s2d2"}, r"m2t rule 's2d2' \(a verification forward\)")]:
        with pytest.raises(ConfigError, match=rf"^{who} needs a fixed block layout; block schedule 'dsb' moves and "
                                              "resizes its block"):
            DecodingPolicy("llada2.1-q", **overrides, **{"blocks.name": "dsb"})
        assert DecodingPolicy("llada2.1-q", **overrides).hooks
