"""The contract suites report a failure as what it is: a rule (or the engine) making a tensor
without a device is called that, but an error the engine raises (a broken contract) or the rule's
own bug surfaces as itself, not as a device error."""

import pytest
import torch

from dlm_toolkit import BLOCKS, M2T, StrategyError, UnmaskRule
from dlm_toolkit.strategy.selection import top1
from dlm_toolkit.testing import BlockScheduleContract, UnmaskRuleContract


class _CommitsOnlyWhenSure(UnmaskRule):  # no fallback: the engine refuses it in a decode
    def __call__(self, ctx):
        return ctx.fillable & (ctx.confidence > 0.99)


class _Buggy(UnmaskRule):  # a shape bug of its own, whatever the device
    def __call__(self, ctx):
        return top1(ctx.confidence, ctx.fillable) | torch.cat([ctx.fillable, ctx.fillable[:, :1]], 1)


class _NoDevice(UnmaskRule):
    def __call__(self, ctx):
        return top1(ctx.confidence, ctx.fillable) | torch.zeros(ctx.batch_size, ctx.width, dtype=torch.bool)


class _NeverEnds(BLOCKS.get("semi_ar")):  # the engine stops it at the per-block forward limit
    def prepare(self, state):
        return ~state.done

    def finish_step(self, state, ctx):
        pass


NAMES = {_CommitsOnlyWhenSure: (M2T, "_reporting_only_when_sure"), _Buggy: (M2T, "_reporting_buggy"),
         _NoDevice: (M2T, "_reporting_no_device"), _NeverEnds: (BLOCKS, "_reporting_never_ends")}


def _suite(base, rule_cls, **attrs):
    """A suite for ``rule_cls``, registered now (not at import: lists of registered rules that other
    test files build while pytest collects must not see it)."""
    registry, name = NAMES[rule_cls]
    if name not in registry.names():
        registry.register(name)(rule_cls)
    return type("Suite", (base,), {"rule_factory": rule_cls, **attrs})()


def test_an_engine_error_in_the_meta_decode_is_raised_as_the_engine_error():
    with pytest.raises(StrategyError, match="committed nothing"):
        _suite(UnmaskRuleContract, _CommitsOnlyWhenSure).test_decode_allocates_on_the_model_device()


def test_a_schedule_the_engine_stops_is_reported_as_the_engine_stopped_it():
    suite = _suite(BlockScheduleContract, _NeverEnds, configs=[{"block_length": 4, "max_post_steps": 1}])
    with pytest.raises(StrategyError, match="exceeded 5 forwards in one block"):
        suite.test_decode_allocates_on_the_model_device()


def test_a_rule_bug_is_raised_as_itself_not_as_a_device_error():
    with pytest.raises(RuntimeError, match="size") as err:
        _suite(UnmaskRuleContract, _Buggy).test_allocates_on_the_inputs_device()
    assert not isinstance(err.value, AssertionError) and "without a device" not in str(err.value)


@pytest.mark.parametrize("test", ["test_allocates_on_the_inputs_device", "test_decode_allocates_on_the_model_device"])
def test_a_tensor_made_without_a_device_is_still_called_that(test):
    with pytest.raises(AssertionError, match="made a tensor without a device"):
        getattr(_suite(UnmaskRuleContract, _NoDevice), test)()
