"""The hook outputs' types, re-exported from their home :mod:`dlm_toolkit.step.outputs` (the step's
leaf package, which hooks, rules and the loop all build on). The same objects: import either path."""

from dlm_toolkit.step.outputs import (  # noqa: F401
    DIMS,
    SCALARS,
    Output,
    Declared,
    HookOutputs,
    hook_label,
)

__all__ = ["DIMS", "SCALARS", "Output", "Declared", "HookOutputs", "hook_label"]
