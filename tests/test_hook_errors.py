"""A plug-in hook's error is one line naming the hook, its stage and what was wrong, with the original
exception chained (issue 42 item 7): an exception in any stage, a selection replaced by a wrong shape or
dtype, an allocation the machine refuses, non-finite logits after a hook touched the step's context.
The near miss of each row: the same hook without the fault decodes."""

from __future__ import annotations

import pytest
import torch

from dlm_toolkit import T2T, ConfigError, DecodingPolicy, StrategyError, decode
from dlm_toolkit.hooks import Declaration, StepHook
from dlm_toolkit.testing import tiny_llada2
from strategies.t2t_threshold import ThresholdEdit

HOOKS: list[StepHook] = []


class WithHooks(ThresholdEdit):
    def step_hooks(self, policy, role):
        return list(HOOKS)


if "_error_hooks" not in T2T.names():
    T2T.register("_error_hooks")(WithHooks)


class Faulty(StepHook):
    """Runs ``fault`` (None: nothing) in ``stage``."""

    name = "hook 'faulty'"

    def __init__(self, stage: str, fault):
        self.stage, self.fault = stage, fault

    def declare(self, policy):
        self.go("declare")
        return Declaration()

    def check_model(self, model):
        self.go("check_model")

    def after_forward(self, ctx, engine, state):
        self.go("after_forward", ctx)

    def after_rules(self, ctx, engine, state):
        self.go("after_rules", ctx)

    def after_write(self, ctx, state):
        self.go("after_write", ctx)

    def step_segments(self, engine, state, live, window):
        self.go("step_segments")
        return ()

    def go(self, stage, ctx=None):
        if stage == self.stage and self.fault is not None:
            self.fault(ctx)


def boom(ctx):
    raise ValueError("boom\nsecond line of a long message")


def key_error(ctx):
    return {}["missing"]


def huge(ctx):
    torch.empty(10 ** 13, dtype=torch.uint8)  # 10 TB: refused by the allocator at once


def edit_shape(ctx):
    ctx.edit = ctx.edit[:, :-1]


def edit_float(ctx):
    ctx.edit = ctx.edit.float()


def edit_list(ctx):
    ctx.commit = ctx.commit.tolist()


def nan_logits(ctx):
    ctx.confidence = torch.full_like(ctx.confidence, float("nan"))


def run(stage: str, fault):
    HOOKS[:] = [Faulty(stage, fault)]
    pol = DecodingPolicy({"m2t": {"name": "threshold", "params": {"threshold": 0.7}},
                          "t2t": {"name": "_error_hooks", "params": {"threshold": 0.5}},
                          "blocks": {"name": "semi_ar", "params": {"block_length": 4, "max_post_steps": 1}}})
    return decode(tiny_llada2(seed=1), [[5, 6, 7]], pol, 8, capture="eager")


CASES = [  # stage, fault, error type, the one line
    ("declare", boom, ConfigError, r"hook 'faulty': declare raised ValueError: boom"),
    ("check_model", key_error, ConfigError, r"hook 'faulty': check_model raised KeyError: 'missing'"),
    ("after_forward", boom, StrategyError, r"hook 'faulty': after_forward raised ValueError: boom"),
    ("after_rules", key_error, StrategyError, r"hook 'faulty': after_rules raised KeyError: 'missing'"),
    ("after_write", boom, StrategyError, r"hook 'faulty': after_write raised ValueError: boom"),
    ("step_segments", boom, StrategyError, r"hook 'faulty': step_segments raised ValueError: boom"),
    ("after_forward", huge, StrategyError, r"hook 'faulty': after_forward ran out of memory \(.*\)"),
    ("after_rules", edit_shape, StrategyError,
     r"hook 'faulty': after_rules set ctx.edit to a torch.bool tensor of shape \(1, 3\); it must stay a torch.bool "
     r"tensor of shape \(1, 4\) \(B, W\)"),
    ("after_rules", edit_float, StrategyError,
     r"hook 'faulty': after_rules set ctx.edit to a torch.float32 tensor of shape \(1, 4\); it must stay a "
     r"torch.bool tensor of shape \(1, 4\) \(B, W\)"),
    ("after_rules", edit_list, StrategyError, r"hook 'faulty': after_rules set ctx.commit to list; it must stay"),
    ("after_forward", nan_logits, StrategyError,
     r"non-finite logits or confidences in forward 1 of batch row 0 \(positions \[0, 1, 2, 3\]\), after hook 'faulty' ran on "
     r"the step's context \(after_forward / after_rules\): check that hook first"),
]


@pytest.mark.parametrize("stage, fault, kind, line", CASES, ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
def test_a_hook_fault_is_one_line_naming_the_hook_and_stage(stage, fault, kind, line):
    with pytest.raises(kind) as caught:
        run(stage, fault)
    text = str(caught.value)
    assert "\n" not in text
    assert caught.match("^" + line)
    if fault not in (edit_shape, edit_float, edit_list, nan_logits):  # the hook's own exception, chained
        assert caught.value.__cause__ is not None and type(caught.value.__cause__) is not kind


@pytest.mark.parametrize("stage", ["declare", "check_model", "after_forward", "after_rules",
                                   "after_write", "step_segments"])
def test_the_same_hook_without_the_fault_decodes(stage):
    assert run(stage, None).rows[0].nfe > 0


def test_the_toolkits_own_errors_from_a_stage_pass_unchanged():
    def own(ctx):
        raise StrategyError("hook 'faulty': a message of its own")

    with pytest.raises(StrategyError, match=r"^hook 'faulty': a message of its own$"):
        run("after_rules", own)
