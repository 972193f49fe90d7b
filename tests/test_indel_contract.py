"""Meta-tests of :class:`~dlm_toolkit.testing.IndelContract` (the built-in ``indel`` rule runs through it in
tests/test_contracts.py, with every built-in): a broken insert/delete rule of each kind fails it, and
its checks see real shifts."""

from __future__ import annotations

import pytest
import torch

from dlm_toolkit import T2T
from dlm_toolkit.hooks.indel import indel_region, written_window
from dlm_toolkit.testing import IndelContract

IndelEdit = T2T.get("indel")


def test_the_suite_sees_shifts_on_random_contexts():
    """The checks of the suite are not vacuous: the permissive config deletes on random contexts (inserts
    need a mask left at the block's end after the commits, which random contexts rarely leave; the
    overflow check is exercised by the meta-test below and the insert path by tests/test_indel.py)."""
    from dlm_toolkit.testing.contracts_cases import random_case

    s = suite(IndelEdit)
    rule = IndelEdit({"delete_threshold": 0.2, "insert_threshold": 0.2, "keep_below": 0.9})
    n_del = 0
    for seed in range(40):
        _, (_, delete) = s.indel_step(rule, random_case(seed), seed)
        n_del += int(delete.sum())
    assert n_del > 0


# -- broken rules, each must fail the suite --------------------------------------------------------
def first(select: torch.Tensor) -> torch.Tensor:
    """(B, W) bool: the first selected slot of each row."""
    return select & (select.long().cumsum(1) == 1)


class _DeletesAPromptToken(IndelEdit):
    def indel(self, ctx):
        return torch.zeros_like(ctx.valid), first(ctx.valid & ctx.is_prompt)


class _InsertsOutsideTheBlock(IndelEdit):
    def indel(self, ctx):
        return first(ctx.valid & ~ctx.in_block), torch.zeros_like(ctx.valid)


class _DeletesAMask(IndelEdit):
    def indel(self, ctx):
        return torch.zeros_like(ctx.valid), first(indel_region(ctx) & (written_window(ctx) == ctx.mask_token_id))


class _OverflowsTheBlock(IndelEdit):  # inserts whether or not the block's end has room
    def indel(self, ctx):
        return first(indel_region(ctx)), torch.zeros_like(ctx.valid)


class _ReturnsLongs(IndelEdit):
    def indel(self, ctx):
        insert, delete = super().indel(ctx)
        return insert.long(), delete.long()


class _ReturnsOneTensor(IndelEdit):
    def indel(self, ctx):
        return super().indel(ctx)[1]


def suite(rule_cls):
    return type("Suite", (IndelContract,), {"rule_factory": rule_cls, "configs": [{}], "n_indel_cases": 30})()


@pytest.mark.parametrize("rule_cls, message", [
    (_DeletesAPromptToken, "delete selects slots .* outside the generated part of the active block"),
    (_InsertsOutsideTheBlock, "insert selects slots .* outside the generated part of the active block"),
    (_DeletesAMask, "delete selects slots .* that hold a mask"),
    (_OverflowsTheBlock, "push written tokens out of the block"),
    (_ReturnsLongs, "has dtype torch.int64, expected torch.bool"),
    (_ReturnsOneTensor, "expected \\(insert, delete\\), two tensors"),
])
def test_a_broken_rule_fails_the_suite(rule_cls, message):
    with pytest.raises(AssertionError, match=message):
        suite(rule_cls).test_indel_contract_on_random_contexts()


def test_a_batch_dependent_rule_fails_the_suite():
    class _DependsOnTheBatch(IndelEdit):
        def indel(self, ctx):
            insert, delete = super().indel(ctx)
            return insert, delete | (first(indel_region(ctx) & (written_window(ctx) != ctx.mask_token_id))
                                     & (ctx.batch_size > 1))

    with pytest.raises(AssertionError, match="inserts/deletes otherwise than alone"):
        suite(_DependsOnTheBatch).test_indel_is_batch_invariant_and_deterministic()

