"""Strategy registries, one per role, filled through the ``dlm_toolkit.strategies`` entry points.

Every package (ours included) that ships strategies declares an entry point in the group
``dlm_toolkit.strategies`` whose value is a module; importing the module registers its classes
with ``@M2T.register("name")`` etc. The built-ins (``strategies/``) use the same path.
Set ``DLM_TOOLKIT_NO_PLUGINS=1`` to load only the built-ins.

A name registered twice (a plug-in's rule named like a built-in, or two plug-ins' rules alike) does
not stop the toolkit: the first registration (the built-in) keeps the name, the load logs a warning,
and only using that name fails, with a message that says how to rename the plug-in's rule or how to
run without plug-ins.

Configs may also name a class directly as ``package.module:Class``. Importing a module runs its
code, and policies also come from files and stores someone else may have written, so a class path
whose module is not imported yet is refused unless imports are allowed: ``--allow-import`` on the
command line, ``allow_import: true`` in an experiment, or :func:`allow_imports` in Python. (A
module already imported runs nothing new: plug-in authors' in-process classes keep working.)
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable, Generic, TypeVar

from dlm_toolkit.config import ConfigError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dlm_toolkit.strategies"
BUILTIN_PLUGIN = "builtin"
BUILTIN_MODULE = "strategies"
NO_PLUGINS_ENV = "DLM_TOOLKIT_NO_PLUGINS"

T = TypeVar("T", bound=type)
_loading: ContextVar[str | None] = ContextVar("_loading", default=None)
_imports_allowed = False


def set_allow_imports(allowed: bool) -> None:
    """Allow (or stop allowing) ``package.module:Class`` names to import their module."""
    global _imports_allowed
    _imports_allowed = bool(allowed)


def imports_allowed() -> bool:
    return _imports_allowed


@contextmanager
def allow_imports(allowed: bool = True) -> Iterator[None]:
    """Within the block, ``package.module:Class`` names may import their module."""
    before = _imports_allowed
    set_allow_imports(allowed)
    try:
        yield
    finally:
        set_allow_imports(before)


class PluginError(ConfigError):
    """A strategy plug-in failed to import, or a name used was registered twice."""


@dataclass(frozen=True)
class Entry:
    name: str
    cls: type
    source: str  # "built-in", a plug-in's entry-point name, or the defining module


class Registry(Generic[T]):
    """Name → strategy class for one role (``m2t``, ``t2t``, ``blocks``, ``remask``)."""

    def __init__(self, role: str, kind: str) -> None:
        self.role, self.kind = role, kind
        self._entries: dict[str, Entry] = {}
        self._clashes: dict[str, str] = {}  # name -> why using it fails (registered twice)

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: ``@M2T.register("threshold")``. A name already taken by another class
        keeps its first class; the clash is logged and raised only where the name is used."""

        def decorate(cls: T) -> T:
            plugin = _loading.get()
            builtin = plugin == BUILTIN_PLUGIN or cls.__module__.startswith(BUILTIN_MODULE + ".")
            source = "built-in" if builtin else plugin or cls.__module__
            old = self._entries.get(name)
            if old is not None and _qualname(old.cls) != _qualname(cls):
                self._clashes[name] = self._clash_message(name, old, cls, source)
                log.warning("%s", self._clashes[name])
                return cls
            self._entries[name] = Entry(name, cls, source)
            cls.registered_name = name
            return cls

        return decorate

    def _clash_message(self, name: str, old: Entry, cls: type, source: str) -> str:
        where = f"plug-in '{source}'" if source != cls.__module__ else f"module {cls.__module__}"
        return (f"{self.role} rule '{name}' registered twice: by {_qualname(old.cls)} ({old.source}) and by "
                f"{_qualname(cls)} ({where}); '{name}' means the first. Rename the second "
                f"(@{self.role.upper()}.register(\"{name}\") in {cls.__module__}), or name it by its class path "
                f"{cls.__module__}:{cls.__qualname__}, or run without plug-ins: {NO_PLUGINS_ENV}=1")

    def get(self, name: str) -> T:
        """The class registered as ``name`` (or a ``package.module:Class`` path).

        Raises:
            PluginError: ``name`` was registered twice (by a plug-in; see the module doc).
            ConfigError: no class is registered as ``name``.
        """
        load_plugins()
        if ":" in name:
            return self._import_path(name)
        if name in self._clashes:
            raise PluginError(self._clashes[name])
        entry = self._entries.get(name)
        if entry is None:
            msg = f"unknown {self.role} rule '{name}'; available: {', '.join(self.names())}"
            if _failed:
                msg += "; plug-ins that failed to load: " + "; ".join(
                    f"{k} ({v})" for k, v in _failed.items()
                )
            raise ConfigError(msg)
        return entry.cls  # type: ignore[return-value]

    def clashes(self) -> dict[str, str]:
        """``{name: message}`` of the names registered twice (each fails where it is used)."""
        load_plugins()
        return dict(self._clashes)

    def names(self) -> list[str]:
        load_plugins()
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        load_plugins()
        return [self._entries[n] for n in sorted(self._entries)]

    def _import_path(self, path: str) -> T:
        from dlm_toolkit.strategy.base import ROLE_BASES

        module, _, attr = path.partition(":")
        if module not in sys.modules and not _imports_allowed:
            raise ConfigError(
                f"{self.role}: '{path}' would import module '{module}'; only registered strategies are used by "
                "default (see `dlm strategies list`). Pass --allow-import (experiments: allow_import: true) to "
                "import it, or register it through a 'dlm_toolkit.strategies' entry point"
            )
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"{self.role}: cannot import '{path}': {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, ROLE_BASES[self.role])):
            raise ConfigError(f"{self.role}: '{path}' is not a {ROLE_BASES[self.role].__name__}")
        return cls  # type: ignore[return-value]


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


M2T: Registry = Registry("m2t", "commit rule")
T2T: Registry = Registry("t2t", "edit rule")
BLOCKS: Registry = Registry("blocks", "block schedule")
REMASK: Registry = Registry("remask", "remask rule")
REGISTRIES: dict[str, Registry] = {r.role: r for r in (M2T, T2T, BLOCKS, REMASK)}

_loaded = False
_failed: dict[str, str] = {}
_plugins: dict[str, str] = {}


def load_plugins() -> None:
    """Import every strategy module once: the built-ins, then third-party entry points."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    eps = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    eps.setdefault(BUILTIN_PLUGIN, BUILTIN_MODULE)  # running from a source tree without install
    order = [BUILTIN_PLUGIN] + sorted(n for n in eps if n != BUILTIN_PLUGIN)
    if os.environ.get(NO_PLUGINS_ENV, "") not in ("", "0"):
        order = [BUILTIN_PLUGIN]
    for name in order:
        token = _loading.set(name)
        try:
            importlib.import_module(eps[name])
            _plugins[name] = eps[name]
        except Exception as err:  # a broken plug-in must not take the toolkit down with it
            if name == BUILTIN_PLUGIN:
                raise
            _failed[name] = f"{eps[name]}: {type(err).__name__}: {err}"
            log.warning("strategy plug-in '%s' failed to import: %s", name, _failed[name])
        finally:
            _loading.reset(token)


def plugin_status() -> dict[str, dict[str, str]]:
    """``{"loaded": {name: module}, "failed": {name: error}}`` for ``dlm strategies list``."""
    load_plugins()
    return {"loaded": dict(_plugins), "failed": dict(_failed)}
