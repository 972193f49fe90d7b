"""Old flat module paths of ``dlm_toolkit`` kept importable after the regroup into subpackages.

Every module that moved keeps its old name as an *alias*: ``import dlm_toolkit.verify`` gives the
very module object ``dlm_toolkit.hooks.verify`` (not a copy), so ``isinstance`` checks, module
attributes and monkeypatching behave as before. One table, one meta-path finder; no module is
imported until its old name is asked for. New code uses the new paths (README "Layout").

regroup: skip -- this file keeps the old names on purpose (the regroup script leaves it alone).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

__all__ = ["OLD_PATHS", "install", "register_loaded"]

# old name under dlm_toolkit -> new name under dlm_toolkit (names without the prefix, so that the
# table itself never looks like a module reference to a rewriting tool)
OLD_PATHS: dict[str, str] = {
    "decode": "step.loop",
    "engine": "step.engine",
    "state": "step.state",
    "capture": "step.capture",
    "rule_capture": "step.rule_capture",
    "sampling": "step.sampling",
    "rng": "step.rng",
    "trajectory": "step.trajectory",
    "verify": "hooks.verify",
    "shadow": "hooks.shadow",
    "indel": "hooks.indel",
    "blocks_dynamic": "hooks.dynamic_blocks",
    "registry": "strategy.registry",
    "policy": "strategy.policy",
    "policy_config": "strategy.policy_config",
    "selection": "strategy.selection",
    "catalogue": "strategy.catalogue",
    "presets": "strategy.presets",
    "training_claim": "training.claim",
    "training_config": "training.config",
    "training_objective": "training.objective",
    "training_resume": "training.resume",
    "evaluate": "evaluation.evaluate",
    "generate": "evaluation.generate",
    "conformance": "evaluation.conformance",
    "stats": "evaluation.stats",
    "plots": "evaluation.plots",
    "tokenizer": "models.tokenizer",
    "chat": "models.chat",
    "files": "util.files",
    "distributed": "util.distributed",
    "runtime": "util.runtime",
    "provenance": "util.provenance",
}
# hooks.py, strategy.py and training.py became packages of the same name that re-export the old
# module's public names; they need no alias.

_PREFIX = "dlm_toolkit."


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module name with the module object of its new home."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX) or fullname[len(_PREFIX):] not in OLD_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_PREFIX + OLD_PATHS[spec.name[len(_PREFIX):]])
        # the import system stamps the alias spec on the module it gets back; keep the real one
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        real = self._specs.pop(module.__spec__.name, None) if module.__spec__ else None
        if real is not None:
            module.__spec__ = real

    _specs: dict[str, importlib.machinery.ModuleSpec] = {}


_FINDER = _AliasFinder()


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def register_loaded() -> None:
    """Enter the old name of every already imported module in ``sys.modules``.

    Needed for ``decode``: the package's attribute ``dlm_toolkit.decode`` is the function, and an
    import through the finder would overwrite it with the module (the import system sets the parent's
    attribute after loading a submodule, but not for a name already in ``sys.modules``).
    """
    for old, new in OLD_PATHS.items():
        module = sys.modules.get(_PREFIX + new)
        if module is not None:
            sys.modules.setdefault(_PREFIX + old, module)


def attribute(name: str) -> ModuleType:
    """``dlm_toolkit.<old name>`` as an attribute (the package's ``__getattr__``)."""
    if name not in OLD_PATHS:
        raise AttributeError(f"module 'dlm_toolkit' has no attribute {name!r}")
    return importlib.import_module(_PREFIX + name)
