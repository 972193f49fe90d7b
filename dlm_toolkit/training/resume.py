"""Resume points for :func:`dlm_toolkit.training.loop.train`: a killed run continues where it stopped.

Every ``checkpoint_interval`` steps ``train()`` writes ``OUT/resume/``:

* ``model.safetensors`` -- the full state dict (router ``expert_bias`` buffers included);
* ``optimizer.safetensors`` -- every per-parameter optimiser tensor, keyed ``state.<index>.<name>``,
  plus the torch generator states (``rng.noise``: the noise generator, ``rng.torch``: the global one);
* ``state.json`` -- written last, so its presence marks a complete resume point: the step, the
  config, the optimiser's param groups, Python's ``random`` state, the loss history and evals so
  far, the partial logging window, elapsed wall/CPU time and the MLflow run id.

Nothing is pickled: tensors go through safetensors, everything else through JSON. A resume point
is written to ``resume.tmp/`` (every file synced) and then swapped in, so a kill while writing
leaves the previous point (or, between the swap's two moves, the complete new one) usable. A full
disk while writing removes ``resume.tmp/`` and raises :class:`~dlm_toolkit.util.files.NoSpaceError`
("no space left on device while writing OUT/resume.tmp/...; the previous resume point is
unchanged"). Reading one back checks every file (regular, bounded, JSON depth, field types).
A resumed run replays the same batches, noise and updates as an uninterrupted one: the weights
match bit for bit on CPU.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dlm_toolkit.config import ConfigError
from dlm_toolkit.util.files import (InputFileError, NoSpaceError, fsync_file, fsync_folder, is_disk_full, parse_json,
                               read_regular, target_mode)

MAX_STATE_BYTES = 256 << 20  # state.json: config, loss history and evals of a long run

# Fields that may differ between the interrupted run and its continuation: they say where and how
# fast to run, or what to log, never which updates happen.
MAY_CHANGE = frozenset({"threads", "device", "eval_n", "eval_interval", "checkpoint_interval"})


@dataclass
class ResumePoint:
    """Everything the training loop needs to continue after ``step`` finished steps."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    py_rng: tuple
    noise_rng: torch.Tensor
    torch_rng: torch.Tensor
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    window: list[float] = field(default_factory=list)
    stats_window: dict[str, list[float]] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    mlflow_run_id: str | None = None
    config: dict[str, Any] = field(default_factory=dict)


def resume_dir(out: Path) -> Path:
    return Path(out) / "resume"


def find(out: Path) -> Path | None:
    """The complete resume point under ``out``, if any (``resume/`` or a fully written ``resume.tmp/``)."""
    for folder in (resume_dir(out), Path(out) / "resume.tmp"):
        if (folder / "state.json").is_file():
            return folder
    return None


def clear(out: Path) -> None:
    """Remove every resume point under ``out`` (the final checkpoint supersedes them)."""
    for folder in (resume_dir(out), Path(out) / "resume.tmp"):
        shutil.rmtree(folder, ignore_errors=True)


def save(out: Path, point: ResumePoint) -> Path:
    """Write ``point`` to ``out/resume/`` without ever leaving zero complete resume points behind.

    Raises:
        NoSpaceError: the disk filled up; ``resume.tmp`` is removed and the previous point kept.
    """
    out = Path(out)
    tmp, final = out / "resume.tmp", resume_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    current = tmp
    try:
        for name, write in _point_files(point).items():  # state.json last: it marks the point complete
            current = tmp / name
            write(current)
            os.chmod(current, target_mode(final / name))
            fsync_file(current)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(err):
            kept = "the previous resume point is unchanged" if find(out) else "no resume point was written"
            raise NoSpaceError(errno.ENOSPC, f"no space left on device while writing {current}; {kept}") from None
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_folder(out)
    return final


def _point_files(point: ResumePoint) -> dict[str, Callable[[Path], object]]:
    """The files of a resume point, each with its writer, in the order they are written."""
    from safetensors.torch import save_file

    tensors = {"rng.noise": point.noise_rng, "rng.torch": point.torch_rng}
    for index, slots in point.optimizer["state"].items():
        for name, value in slots.items():
            tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
    version, internal, gauss = point.py_rng
    state = {
        "step": point.step, "config": point.config, "param_groups": point.optimizer["param_groups"],
        "py_rng": [version, list(internal), gauss], "history": point.history, "evals": point.evals,
        "window": point.window, "stats_window": point.stats_window, "wall_s": point.wall_s,
        "cpu_s": point.cpu_s, "mlflow_run_id": point.mlflow_run_id,
    }
    model = {k: v.detach().cpu().contiguous() for k, v in point.model.items()}
    return {
        "model.safetensors": lambda file: save_file(model, file),
        "optimizer.safetensors": lambda file: save_file(tensors, file),
        "state.json": lambda file: file.write_text(json.dumps(state) + "\n"),
    }


def read_state(folder: Path) -> dict[str, Any]:
    """``state.json`` of a resume point, checked (regular file, size, JSON depth, an object)."""
    file = Path(folder) / "state.json"
    try:
        state = parse_json(read_regular(file, MAX_STATE_BYTES, "a resume state file"), str(file))
    except InputFileError as err:
        raise ConfigError(f"resume: {err}; delete {folder} to start over") from None
    if not isinstance(state, dict):
        raise ConfigError(f"resume: {file} must hold a JSON object; delete {folder} to start over")
    return state


def peek_step(folder: Path) -> Any:
    """The step a resume point was written at, for messages ("?" when unreadable)."""
    try:
        step = read_state(folder).get("step", "?")
    except ConfigError:
        return "?"
    return step if isinstance(step, int) else "?"


def load(folder: Path, config: dict[str, Any]) -> ResumePoint:
    """Read the resume point in ``folder``; ``config`` (the new run's, as JSON) must match its own.

    Raises :class:`~dlm_toolkit.config.ConfigError` naming the unreadable file, or the config
    fields that differ (only :data:`MAY_CHANGE` fields may).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    hint = f"; delete {folder} to start over"
    state = read_state(folder)
    try:
        step, groups, (version, internal, gauss) = state["step"], state["param_groups"], state["py_rng"]
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"step must be a positive integer, got {step!r}")
        if not isinstance(state["config"], dict):
            raise ValueError("config must be an object")
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"resume: {folder / 'state.json'} is unreadable ({err}){hint}") from None
    differ = sorted(k for k in set(config) | set(state["config"])
                    if k not in MAY_CHANGE and config.get(k) != state["config"].get(k))
    if differ:
        raise ConfigError("resume: the config differs from the interrupted run's in "
                          + ", ".join(f"{k} ({state['config'].get(k)!r} there, {config.get(k)!r} here)" for k in differ)
                          + f"; only {sorted(MAY_CHANGE)} may change -- use another --out for a new run")
    tensors = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        try:
            tensors[name] = load_file(folder / name)
        except (OSError, SafetensorError, ValueError) as err:
            raise ConfigError(f"resume: {folder / name} is unreadable ({err}){hint}") from None
    opt_tensors = tensors["optimizer.safetensors"]
    missing = sorted({"rng.noise", "rng.torch"} - set(opt_tensors))
    if missing:
        raise ConfigError(f"resume: {folder / 'optimizer.safetensors'} lacks {missing}{hint}")
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in opt_tensors.items():
        if key.startswith("state."):
            _, index, name = key.split(".", 2)
            slots.setdefault(int(index), {})[name] = value
    return ResumePoint(
        step=step, model=tensors["model.safetensors"], optimizer={"state": slots, "param_groups": groups},
        py_rng=(version, tuple(internal), gauss), noise_rng=opt_tensors["rng.noise"],
        torch_rng=opt_tensors["rng.torch"], history=state["history"], evals=state["evals"],
        window=state["window"], stats_window=state["stats_window"], wall_s=state["wall_s"],
        cpu_s=state["cpu_s"], mlflow_run_id=state["mlflow_run_id"], config=state["config"],
    )


def restore(point: ResumePoint, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: random.Random,
            gen: torch.Generator) -> None:
    """Put ``point`` back into the freshly built model, optimiser and generators."""
    try:
        model.load_state_dict(point.model)
    except RuntimeError as err:  # names the missing / unexpected / mis-shaped keys
        raise ConfigError(f"resume: the saved model does not fit this config: {err}") from None
    try:
        opt.load_state_dict(point.optimizer)
    except (ValueError, KeyError, RuntimeError) as err:
        raise ConfigError(f"resume: the saved optimiser state does not fit this model: {err}") from None
    rng.setstate(point.py_rng)
    gen.set_state(point.noise_rng)
    torch.set_rng_state(point.torch_rng)
