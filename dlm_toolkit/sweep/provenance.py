"""Where a result came from: the code that served the policy and the machine it ran on.

:func:`collect` records, for every strategy class a policy uses, its module, the distribution that
installed it (name and version) and a SHA-256 of the module's source file, plus the toolkit's
version and git commit (in a checkout), torch / transformers / Python versions, and the model's
device and dtype. ``dlm eval --json`` prints it, MLflow eval and trial runs carry it (tags and a
``provenance.json`` artifact), and ``dlm replay`` warns when a plug-in's source changed since the
trial ran (:func:`changed_plugins`).
"""

from __future__ import annotations

import hashlib
import inspect
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["changed_plugins", "collect", "plugin_hashes"]


@lru_cache(maxsize=None)
def _file_hash(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def _dist_of(module: str) -> tuple[str | None, str | None]:
    names = _distributions().get(module.split(".")[0]) or []
    if not names:
        return None, None
    try:
        return names[0], metadata.version(names[0])
    except metadata.PackageNotFoundError:
        return names[0], None


@lru_cache(maxsize=1)
def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _plugin(role: str, name: str) -> dict[str, Any]:
    from dlm_toolkit.strategy.registry import REGISTRIES

    cls = REGISTRIES[role].get(name)
    module = cls.__module__
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        source = None
    dist, version = _dist_of(module)
    return {"role": role, "name": name, "class": f"{module}:{cls.__qualname__}", "distribution": dist,
            "version": version, "sha256": _file_hash(source) if source else None}


def collect(policy: Any, model: Any = None) -> dict[str, Any]:
    """The provenance of a result of ``policy`` (a :class:`~dlm_toolkit.strategy.policy_config.PolicyConfig` or
    :class:`~dlm_toolkit.decoding.policy.DecodingPolicy`) computed with ``model`` (device and dtype)."""
    import torch
    import transformers

    import dlm_toolkit

    config = getattr(policy, "config", policy)
    plugins = [_plugin(role, getattr(config, role).name) for role in ("m2t", "t2t", "blocks", "remask")]
    device = dtype = None
    if model is not None:
        from dlm_toolkit.models.base import model_device

        device = str(model_device(model))
        dtype = str(getattr(model, "dtype", "")).removeprefix("torch.") or None
    return {"toolkit_version": dlm_toolkit.__version__, "git_commit": _git_commit(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "device": device,
            "dtype": dtype, "plugins": plugins}


def plugin_hashes(provenance: dict[str, Any]) -> dict[str, str]:
    """``{class path: sha256}`` of the plug-ins in a provenance record (compact, for a trial attribute)."""
    return {p["class"]: p["sha256"] for p in provenance.get("plugins", []) if p.get("sha256")}


def changed_plugins(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """Warnings for plug-ins whose source hash differs from (or is missing against) the record."""
    out = []
    for cls, digest in sorted(recorded.items()):
        now = current.get(cls)
        if now != digest:
            out.append(f"plug-in {cls} changed since the trial ran (recorded sha256 {digest[:12]}, "
                       f"now {now[:12] if now else 'not used'}): results may differ")
    return out
