"""Contract test suites for strategy authors, in the style of ``optuna.testing``.

Subclass the suite of your rule's role in your own pytest file; pytest then runs every
``test_*`` method below against your rule::

    from dlm_toolkit.testing import UnmaskRuleContract
    from my_package.rules import MyRule

    class TestMyRule(UnmaskRuleContract):
        rule_factory = MyRule                       # a class, or any callable(config) -> rule
        configs = [{}, {"threshold": 0.5}]          # optional: configs to check (default: [{}])
        uses_randomness = False                     # True if the rule draws random numbers (ctx.rand)

The suites check the role's contract on many random contexts (random masks, prompts, blocks,
edit windows; flat, peaked, uniform and one-hot logits) built with
:func:`~dlm_toolkit.testing.make_context`, over three consecutive steps that share memory:
the selection's type and shape, that it stays inside the allowed positions (the contexts hold
masks outside the active block and left padding, which no role may select), progress, batch
invariance (row i of a batch selects what row i alone selects, random rules included: each row
draws from its own stream), determinism under a seed, that the rule allocates nothing off the
device of its inputs (it runs with the default device pointed at ``meta``, so a tensor made
without ``device=`` fails), that it keeps no state on itself, config round trips (dict and JSON
via ``rule.spec()``), rejection of unknown keys and out-of-range values, and an end-to-end decode
with a scripted model that must finish with no mask left. The base classes have no ``Test`` prefix, so pytest collects only your subclasses.
Override :meth:`~_StrategyContract.make_rule` instead of ``rule_factory`` when building the
rule needs more than a config, and :meth:`~_RuleContract.is_random` when only some configs
draw random numbers.

Import the suites from here; they are written in ``contracts_cases`` (random contexts),
``contracts_base`` (what every role is checked for), ``contracts_rules`` (M2T, T2T, remask) and
``contracts_blocks`` (block schedules), ``contracts_dynamic_blocks`` (schedules that move their own
block), ``contracts_verify`` (M2T rules with a verification forward), ``contracts_indel`` (T2T rules with
insert/delete edits).
"""

from dlm_toolkit.testing.contracts_base import _StrategyContract
from dlm_toolkit.testing.contracts_blocks import BlockScheduleContract
from dlm_toolkit.testing.contracts_dynamic_blocks import DynamicBlockScheduleContract
from dlm_toolkit.testing.contracts_cases import STEPS, advance, build_context, random_case
from dlm_toolkit.testing.contracts_indel import IndelContract
from dlm_toolkit.testing.contracts_rules import EditRuleContract, RemaskRuleContract, UnmaskRuleContract, _RuleContract
from dlm_toolkit.testing.contracts_verify import VerifierContract

__all__ = ["UnmaskRuleContract", "VerifierContract", "EditRuleContract", "IndelContract", "RemaskRuleContract", "BlockScheduleContract",
           "DynamicBlockScheduleContract", "random_case", "build_context"]
