"""Old module paths of ``dlm_toolkit`` kept importable after the regroup into subpackages (flat
names such as ``dlm_toolkit.verify``, and the subpackage paths of modules moved again so that the
packages import one way, such as ``dlm_toolkit.step.loop``).

Every module that moved keeps its old name as an *alias*: ``import dlm_toolkit.verify`` gives the
very module object ``dlm_toolkit.hooks.verify`` (not a copy), so ``isinstance`` checks, module
attributes and monkeypatching behave as before. One table, one meta-path finder; no module is
imported until its old name is asked for. New code uses the new paths (README "Layout").

Each old path is deprecated: its first import (or attribute access) in a process warns with a
``DeprecationWarning`` that names the new path and the version that removes the alias
(:data:`REMOVAL_VERSION`), as diffusers' ``deprecate()`` does. The aliases go in that version;
:func:`deprecate` refuses to run once ``dlm_toolkit.__version__`` reaches it, so they cannot outlive it.

regroup: skip -- this file keeps the old names on purpose (the regroup script leaves it alone).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__all__ = ["OLD_PATHS", "REMOVAL_VERSION", "deprecate", "install", "register_loaded"]

REMOVAL_VERSION = "0.3.0"  # the release that deletes this module and every old path

# old name under dlm_toolkit -> new name under dlm_toolkit (names without the prefix, so that the
# table itself never looks like a module reference to a rewriting tool). An old name may be dotted
# ("util.provenance"): the finder sits last on sys.meta_path, so it answers only once the real
# subpackage has no such file.
OLD_PATHS: dict[str, str] = {
    "decode": "decoding.loop",
    "engine": "decoding.engine",
    "state": "step.state",
    "capture": "step.capture",
    "rule_capture": "decoding.rule_capture",
    "sampling": "step.sampling",
    "rng": "step.rng",
    "trajectory": "step.trajectory",
    "verify": "hooks.verify",
    "shadow": "hooks.shadow",
    "indel": "hooks.indel",
    "blocks_dynamic": "hooks.dynamic_blocks",
    "registry": "strategy.registry",
    "policy": "decoding.policy",
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
    "distributed": "models.distributed",
    "runtime": "util.runtime",
    "provenance": "sweep.provenance",
    # moved out of util, which sits below everything (issue 43: no package circle)
    "util.distributed": "models.distributed",
    "util.provenance": "sweep.provenance",
    # the loop and what composes rules with hooks sit above step, strategy and hooks (issue 43)
    "step.loop": "decoding.loop",
    "step.engine": "decoding.engine",
    "step.rule_capture": "decoding.rule_capture",
    "strategy.policy": "decoding.policy",
}
# hooks.py, strategy.py and training.py became packages of the same name that re-export the old
# module's public names; they need no alias.

_PREFIX = "dlm_toolkit."


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside this module, ``importlib.import_module`` and
    the package's ``__getattr__``: the warning then names the user's ``import`` line. (``warnings``
    itself skips the frozen import machinery's frames, so they are not counted.)"""
    here = {__file__, __file__.replace("_aliases.py", "__init__.py"), importlib.__file__}
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if name not in here:
            break
        frame, level = frame.f_back, level + 1
    return level


def deprecate(old: str) -> None:
    """Warn that the old path ``dlm_toolkit.<old>`` goes in :data:`REMOVAL_VERSION`, naming its new path.

    Raises:
        RuntimeError: the package's version has reached :data:`REMOVAL_VERSION` (the aliases are
            overdue: delete this module, as diffusers' ``deprecate()`` insists).
    """
    __version__ = sys.modules[_PREFIX[:-1]].__version__  # loaded: every alias is reached through it
    if _version_tuple(__version__) >= _version_tuple(REMOVAL_VERSION):
        raise RuntimeError(f"dlm_toolkit {__version__} still has the old path {_PREFIX}{old}, "
                           f"deprecated until {REMOVAL_VERSION}: delete dlm_toolkit/_aliases.py")
    warnings.warn(f"{_PREFIX}{old} is deprecated and will be removed in dlm-toolkit {REMOVAL_VERSION}; "
                  f"import {_PREFIX}{OLD_PATHS[old]} instead", DeprecationWarning,
                  stacklevel=_caller_stacklevel())


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module name with the module object of its new home."""

    def find_spec(self, fullname: str, path: object = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX) or fullname[len(_PREFIX):] not in OLD_PATHS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        deprecate(spec.name[len(_PREFIX):])
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


class _Package(ModuleType):
    """The class of the ``dlm_toolkit`` module object: its attribute ``decode`` is the function.

    The import system sets a parent's attribute to each submodule it loads; after
    ``import dlm_toolkit.decode`` (the old module path, through the finder) that would replace the
    function by the module. The old path still gives the module from ``sys.modules``."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "decode" and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    package = sys.modules.get(_PREFIX[:-1])
    if package is not None and type(package) is ModuleType:
        package.__class__ = _Package


def register_loaded() -> None:
    """Kept for callers of the old package ``__init__``: nothing to do. Old names are no longer
    entered in ``sys.modules`` ahead of use, so that each one's first import goes through the finder
    and warns."""


def attribute(name: str) -> ModuleType:
    """``dlm_toolkit.<old name>`` as an attribute (the package's ``__getattr__``); warns through the
    finder like an import."""
    if name not in OLD_PATHS:
        raise AttributeError(f"module 'dlm_toolkit' has no attribute {name!r}")
    return importlib.import_module(_PREFIX + name)
