"""Step hooks written against the members that :meth:`StepHook.declare <dlm_toolkit.hooks.base.StepHook.declare>`
replaced, kept running until dlm-toolkit 0.3.0.

Before, a hook declared itself with eight members (``outputs``, ``key()``, ``device_flags()``,
``check_policy(policy)``, ``forward_budget(policy)``, ``budget_source(policy)``, ``moves_block``,
``needs_fixed_block``); now ``declare(policy)`` returns one :class:`~dlm_toolkit.hooks.base.Declaration`
holding the same facts (and raises to refuse the policy, as ``check_policy`` did). A hook that defines
any of the old members and no ``declare`` gets its declaration built from them, with a
``DeprecationWarning`` naming each member's new place; the translation refuses to run once
``dlm_toolkit.__version__`` reaches :data:`~dlm_toolkit._aliases.REMOVAL_VERSION`, so it cannot
outlive its deadline (as the old module paths of :mod:`dlm_toolkit._aliases`).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from dlm_toolkit._aliases import REMOVAL_VERSION

# old member -> where it went (a field of the Declaration, or declare itself)
LEGACY = {
    "outputs": "Declaration(outputs=...)",
    "key": "Declaration(key=...)",
    "device_flags": "Declaration(flags=...)",
    "check_policy": "declare(policy) raising ConfigError",
    "forward_budget": "Declaration(forward_budget=...)",
    "budget_source": "Declaration(budget_source=...)",
    "moves_block": "Declaration(moves_block=True)",
    "needs_fixed_block": "Declaration(needs_fixed_block='why')",
}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def legacy_members(hook: Any) -> list[str]:
    """The replaced members ``hook`` defines, in :data:`LEGACY` order."""
    return [name for name in LEGACY if hasattr(hook, name)]


def warn_legacy(who: str, old: list[str]) -> None:
    """One ``DeprecationWarning`` naming each replaced member ``who`` defines and where it went.

    Raises:
        RuntimeError: the package's version has reached ``REMOVAL_VERSION`` (delete this module).
    """
    version = sys.modules["dlm_toolkit"].__version__
    if _version(version) >= _version(REMOVAL_VERSION):
        raise RuntimeError(f"dlm_toolkit {version} still translates the old hook members, deprecated until "
                           f"{REMOVAL_VERSION}: delete dlm_toolkit/hooks/legacy.py")
    warnings.warn(f"{who}: the step-hook members {', '.join(old)} are deprecated and stop working in dlm-toolkit "
                  f"{REMOVAL_VERSION}; define declare(policy) returning dlm_toolkit.hooks.Declaration instead ("
                  + "; ".join(f"{name} -> {LEGACY[name]}" for name in old) + ")", DeprecationWarning, stacklevel=4)


def legacy_fields(hook: Any, policy: Any) -> dict[str, Any]:
    """The :class:`~dlm_toolkit.hooks.base.Declaration` fields of a hook that defines replaced members
    (running its ``check_policy``, which may refuse the policy)."""
    if hasattr(hook, "check_policy"):
        hook.check_policy(policy)
    fields: dict[str, Any] = {}
    if hasattr(hook, "outputs"):
        fields["outputs"] = hook.outputs
    if hasattr(hook, "key"):
        fields["key"] = hook.key()
    if hasattr(hook, "device_flags"):
        flags = hook.device_flags()
        fields["flags"] = list(flags) if isinstance(flags, (list, tuple)) else flags
    if hasattr(hook, "forward_budget"):
        fields["forward_budget"] = hook.forward_budget(policy)
        fields["budget_source"] = hook.budget_source(policy) if hasattr(hook, "budget_source") else "forward_budget()"
    for name in ("moves_block", "needs_fixed_block"):
        if hasattr(hook, name):
            fields[name] = getattr(hook, name)
    return fields
