"""The step-hook protocol (``base``) and the built-in hooks, one per file.

Re-exports the public names of ``base.py`` (the module this package replaced)."""

from dlm_toolkit.hooks.base import (  # noqa: F401
    ROLES,
    STAGES,
    Declaration,
    StepHook,
    collect,
    HookStages,
)

__all__ = [
    "ROLES",
    "STAGES",
    "Declaration",
    "StepHook",
    "collect",
    "HookStages",
]
