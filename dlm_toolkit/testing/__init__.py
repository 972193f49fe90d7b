"""Test helpers shipped with the library: scripted models and contract suites for plug-ins."""

from dlm_toolkit.testing.context import make_context
from dlm_toolkit.testing.host_syncs import HostSyncs
from dlm_toolkit.testing.models import tiny_llada2, tiny_llada2_config
from dlm_toolkit.testing.scripted import ScriptedLM, mixing_logits, table_logits

__all__ = ["tiny_llada2", "tiny_llada2_config", "make_context", "HostSyncs", "ScriptedLM", "mixing_logits", "table_logits",
           "UnmaskRuleContract", "EditRuleContract", "RemaskRuleContract", "BlockScheduleContract",
           "DynamicBlockScheduleContract", "VerifierContract", "IndelContract", "StepHookContract"]

_CONTRACTS = ("UnmaskRuleContract", "EditRuleContract", "RemaskRuleContract", "BlockScheduleContract",
              "DynamicBlockScheduleContract", "VerifierContract", "IndelContract")


def __getattr__(name: str):
    """The contract suites import pytest, so they load on first use only."""
    if name == "StepHookContract":
        from dlm_toolkit.testing.contracts_hooks import StepHookContract

        return StepHookContract
    if name in _CONTRACTS:
        from dlm_toolkit.testing import contracts

        return getattr(contracts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
