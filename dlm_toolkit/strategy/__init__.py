"""The strategy authoring API (``base``), the registry, policies and the catalogue.

Re-exports the public names of ``base.py`` (the module this package replaced)."""

from dlm_toolkit.strategy.base import (  # noqa: F401
    cached_property,
    Selection,
    StepContext,
    Strategy,
    UnmaskRule,
    EditRule,
    RemaskRule,
    BlockSchedule,
    ROLE_BASES,
    Output,
    HookOutputs,
)

__all__ = [
    "cached_property",
    "Selection",
    "StepContext",
    "Strategy",
    "UnmaskRule",
    "EditRule",
    "RemaskRule",
    "BlockSchedule",
    "ROLE_BASES",
    "Output",
    "HookOutputs",
]
