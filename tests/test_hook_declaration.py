"""What a step hook declares (``declare(policy) -> Declaration``): each field checked when the policy is
built, naming the hook and the field (a near miss beside each refusal); keys merge hooks; the built-in
hooks declare without the deprecated members; and hooks written against those members still run, the
same, with a warning naming each member's new place, until the removal version."""

from __future__ import annotations

import warnings

import pytest
import torch

import dlm_toolkit
from dlm_toolkit import ConfigError, DecodingPolicy, decode
from dlm_toolkit.hooks import Declaration, StepHook
from dlm_toolkit.hooks.legacy import LEGACY
from dlm_toolkit.step.flags import DeviceFlag, set_flag
from dlm_toolkit.strategy import Output
from dlm_toolkit.testing import tiny_llada2
from strategies.t2t_threshold import ThresholdEdit
from test_flags import asking


class Declares(StepHook):
    """Declares whatever it is built with."""

    name = "hook 'declares'"

    def __init__(self, **fields):
        self.fields = fields

    def declare(self, policy):
        return Declaration(**self.fields)


class ReturnsDict(StepHook):
    name = "hook 'dict'"

    def declare(self, policy):
        return {"outputs": {}}


def with_hooks(*hooks: StepHook, **overrides) -> DecodingPolicy:
    """``llada2.1-q`` (blocks of 32) whose T2T rule, the threshold edit, asks for ``hooks``."""
    return DecodingPolicy("llada2.1-q", **{"t2t.name": asking(*hooks, base=ThresholdEdit), **overrides})


BAD = [  # fields, the refusal after "hook 'declares': "
    ({"outputs": [("x", Output(("B",), torch.bool))]}, r"Declaration.outputs must map output names to .*Output, got list"),
    ({"budget_source": 3}, r"Declaration.budget_source must be a str, got int"),
    ({"moves_block": 1}, r"Declaration.moves_block must be a bool, got int"),
    ({"needs_fixed_block": True}, r"Declaration.needs_fixed_block must be a str, got bool"),
    ({"key": ["a"]}, r"Declaration.key must be hashable, got list"),
    ({"forward_budget": 1.5}, r"declare\(policy\).forward_budget = 1.5: must be an integer in \[0, 6144\], .*"),
    ({"forward_budget": True}, r"declare\(policy\).forward_budget = True: must be an integer in \[0, 6144\], .*"),
    ({"forward_budget": 6145}, r"declare\(policy\).forward_budget = 6145: must be an integer in \[0, 6144\], .*"),
    ({"forward_budget": -1}, r"declare\(policy\).forward_budget = -1: must be an integer in \[0, 6144\], .*"),
    ({"forward_budget": 2, "budget_source": "max_toy(32)"}, None),
]


@pytest.mark.parametrize("fields, why", [b for b in BAD if b[1] is not None], ids=lambda v: str(v)[:40])
def test_each_declared_field_is_checked_naming_the_hook_and_the_field(fields, why):
    with pytest.raises(ConfigError, match=rf"^hook 'declares': {why}$"):
        with_hooks(Declares(**fields))


def test_near_misses_of_the_refusals_are_accepted_and_counted():
    # 32-wide windows: the cap is 64 x 32 + 4096 = 6144, accepted at the bound
    top = with_hooks(Declares(forward_budget=6144, moves_block=False, needs_fixed_block="", key=("a", 1),
                              outputs={"x": Output(("B",), torch.bool)}))
    assert top.forward_limit() == 48 + 6144 and top.declarations[0].key == ("a", 1)
    with pytest.raises(ConfigError, match=r"^hook 'declares': max_toy\(32\) = 6145: must be an integer"):
        with_hooks(Declares(forward_budget=6145, budget_source="max_toy(32)"))  # the refusal names the source
    with pytest.raises(ConfigError, match=r"^hook 'dict': declare\(policy\) must return a dlm_toolkit.hooks.Declaration, "
                                          r"got dict$"):
        with_hooks(ReturnsDict())


def test_equal_keys_make_one_hook_the_first_and_no_key_keeps_each_object():
    a, b, c = Declares(key="k", forward_budget=1), Declares(key="k", forward_budget=5), Declares(key="other")
    policy = with_hooks(a, b, c)
    assert policy.hooks == (a, c) and policy.forward_limit() == 48 + 1
    d, e = Declares(forward_budget=1), Declares(forward_budget=1)  # near miss: no key, two objects
    assert with_hooks(d, e).hooks == (d, e) and with_hooks(d, e).forward_limit() == 48 + 2


class ReadsPolicy(StepHook):
    name = "hook 'reads'"

    def declare(self, policy):
        if policy.remask.name == "none":
            raise ConfigError("hook 'reads': needs a remask rule")
        return Declaration(forward_budget=policy.blocks.block_length // 4)


def test_declare_sees_the_policy_being_built_and_may_refuse_it():
    with pytest.raises(ConfigError, match=r"^hook 'reads': needs a remask rule$"):
        with_hooks(ReadsPolicy())
    ok = with_hooks(ReadsPolicy(), **{"remask.name": "low_confidence", "blocks.params.block_length": 16})
    assert ok.forward_limit() == ok.blocks.max_forwards_per_block() + 4


BUILT_IN = [{"m2t.name": "s2d2"}, {"t2t.name": "indel"}, {"m2t.name": "wino", "remask.name": "wino_shadow"},
            {"blocks.name": "dsb"}]


@pytest.mark.parametrize("overrides", BUILT_IN, ids=lambda o: "-".join(o.values()))
def test_built_in_hooks_declare_without_the_replaced_members(overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        policy = DecodingPolicy("llada2.1-q", **overrides)
    assert policy.hooks and all(not any(hasattr(h, name) for name in LEGACY) for h in policy.hooks)


# -- the replaced members ------------------------------------------------------------------------
FLAG = DeviceFlag("toy_late", lambda hit: f"{hit.owner}: row {hit.row} too late")


def first_of_block(ctx):
    before = torch.cat([torch.zeros_like(ctx.in_block[:, :1]), ctx.in_block[:, :-1]], 1)
    return ctx.in_block & ~before & ctx.valid


class FreezeNew(StepHook):
    name = "hook 'freeze'"

    def declare(self, policy):
        if policy.remask.name == "wino_shadow":
            raise ConfigError("hook 'freeze': not with a shadow block")
        return Declaration(outputs={"frozen": Output(("B", "W"), torch.bool)}, flags=[FLAG], key="freeze",
                           forward_budget=policy.blocks.block_length, budget_source="max_freeze()")

    def after_rules(self, ctx, engine, state):
        frozen = first_of_block(ctx)
        ctx.edit = ctx.edit & ~frozen
        ctx.hooks.frozen = frozen
        set_flag(state, FLAG, ctx.step > 10 ** 6)


class FreezeOld(StepHook):
    """The same hook written against the eight replaced members."""

    name = "hook 'freeze'"
    outputs = {"frozen": Output(("B", "W"), torch.bool)}
    moves_block = False
    needs_fixed_block = ""

    def key(self):
        return "freeze"

    def device_flags(self):
        return [FLAG]

    def check_policy(self, policy):
        if policy.remask.name == "wino_shadow":
            raise ConfigError("hook 'freeze': not with a shadow block")

    def forward_budget(self, policy):
        return policy.blocks.block_length

    def budget_source(self, policy):
        return "max_freeze()"

    after_rules = FreezeNew.after_rules


def test_a_hook_with_the_replaced_members_warns_naming_each_and_decodes_the_same():
    edits = {"t2t.params.threshold": 0.0, "blocks.params.block_length": 8}  # edits at blocks' first positions
    with pytest.warns(DeprecationWarning) as caught:
        old = with_hooks(FreezeOld(), **edits)
    text = " ".join(str(w.message) for w in caught if "step-hook members" in str(w.message))
    assert text.startswith("hook 'freeze': the step-hook members ") and "dlm-toolkit 0.3.0" in text
    for name, where in LEGACY.items():
        assert f"{name} -> {where}" in text
    new = with_hooks(FreezeNew(), **edits)
    assert old.declarations == new.declarations and old.forward_limit() == new.forward_limit() == 8 + 16 + 8
    model = tiny_llada2(seed=2)
    a = decode(model, [[5, 6, 7], [8, 9]], old, 16, record=True)
    b = decode(model, [[5, 6, 7], [8, 9]], new, 16, record=True)
    assert a.tokens == b.tokens and [r.nfe for r in a.rows] == [r.nfe for r in b.rows]
    plain = decode(model, [[5, 6, 7], [8, 9]], DecodingPolicy("llada2.1-q", **edits), 16)
    assert plain.tokens != a.tokens  # near miss: the hook acts on these prompts
    with pytest.raises(ConfigError, match=r"^hook 'freeze': not with a shadow block$"):
        with_hooks(FreezeOld(), **{"m2t.name": "wino", "remask.name": "wino_shadow"})


def test_the_replaced_members_stop_working_at_the_removal_version(monkeypatch):
    monkeypatch.setattr(dlm_toolkit, "__version__", "0.3.0")
    with pytest.raises(RuntimeError, match=r"still translates the old hook members, deprecated until 0.3.0: delete "
                                           r"dlm_toolkit/hooks/legacy.py"):
        with_hooks(FreezeOld())
    monkeypatch.setattr(dlm_toolkit, "__version__", "0.2.9")  # near miss: the last version that warns
    with pytest.warns(DeprecationWarning):
        with_hooks(FreezeOld())


def test_a_hook_with_declare_and_a_replaced_member_is_refused():
    class Both(FreezeNew):
        def key(self):
            return "freeze"

    with pytest.raises(ConfigError, match=r"^hook 'freeze': defines declare\(policy\) and the members it replaced "
                                          r"\(key\): move them into the Declaration that declare returns$"):
        with_hooks(Both())
    with_hooks(FreezeNew())  # near miss
