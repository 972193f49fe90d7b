"""The strategy authoring API (``base``), the registry, policy configs and the catalogue.

``DecodingPolicy`` (rules and hooks composed) lives above in :mod:`dlm_toolkit.decoding.policy`.

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
