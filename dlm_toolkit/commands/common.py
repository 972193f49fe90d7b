"""What every ``dlm`` subcommand shares: how a policy, the runtime options and a checkpoint are
taken from the command line. Subcommand modules import this one, never :mod:`dlm_toolkit.cli`."""

from __future__ import annotations

import argparse
import inspect
import os
from typing import Any, Sequence

from dlm_toolkit.config import ConfigError, parse_value, utf8_argument
from dlm_toolkit.strategy.policy_config import PolicyConfig, load_policy


def parse_sets(items: Sequence[str] | None) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` → ``{"a.b": 1, "c": "x"}`` (values parsed as JSON where possible)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. m2t.params.threshold=0.8")
        out[key.strip()] = parse_value(value.strip())
    return out


def add_policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", help="named policy (see `dlm strategies presets`); default llada2.1-q")
    g.add_argument("--policy", help="policy file (.json or .yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="flat-key override, repeatable")
    add_import_arg(p)


def add_import_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-import", action="store_true",
                   help="let policies name strategy classes as package.module:Class (imports that module), and the "
                        "lm_eval task read task files from a folder or path (task argument include_path; lm-eval "
                        "imports their !function Python, unsandboxed); never read from a file or a store")


def policy_from_args(args: argparse.Namespace) -> PolicyConfig:
    return load_policy(args.policy or args.preset, parse_sets(args.set))


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype``, ``--threads``, ``--cuda-graphs/--no-cuda-graphs``: the same options on
    every command that runs a model (all of them decode)."""
    g = p.add_argument_group("where and how to run")
    g.add_argument("--device", help="cpu (default), cuda or cuda:N")
    g.add_argument("--dtype", help="weight dtype: float32 (CPU default), bfloat16 (GPU default) or float16")
    g.add_argument("--threads", type=int, help="intra-op CPU threads (default: 1 for small models, torch's default otherwise)")
    add_cuda_graphs_arg(g)


def add_cuda_graphs_arg(g: Any) -> None:
    """``--cuda-graphs/--no-cuda-graphs`` (``args.cuda_graphs``: True, False or None for auto)."""
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture each model forward in a CUDA graph and replay it (default: on when the device is "
                        "CUDA); --no-cuda-graphs runs every forward eagerly, to compare (same tokens)")


def check_cuda_graphs(cuda_graphs: bool | None, devices: Sequence[str | None], option: str = "--cuda-graphs") -> None:
    """Refuse CUDA graphs asked for where a model runs on something else (``None``: the CPU), in one
    line and before any work; ``None`` (auto) and False always pass."""
    if not cuda_graphs:
        return
    for device in devices:
        where = device or "cpu"
        if not where.startswith("cuda"):
            raise ConfigError(f"{option} needs a CUDA device (--device cuda); this run is on {where}")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{option} needs a CUDA device; torch sees none on this machine")


def load_for_args(args: argparse.Namespace, path: str, need_tokenizer: bool = True, **ids: int | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of checkpoint ``path`` on ``--device`` in ``--dtype``, with ``--threads``
    applied; ``ids``: ``mask_token_id``/``eos_token_id`` overrides. Under ``torchrun`` each rank
    loads its shard of the model and only rank 0 prints (see :mod:`dlm_toolkit.models.distributed`)."""
    from dlm_toolkit.models.distributed import init_from_env
    from dlm_toolkit.evaluation.evaluate import load_checkpoint
    from dlm_toolkit.util.runtime import apply_threads, is_small, resolve_dtype, resolve_threads

    resolve_threads(args.threads, small_model=True)  # a bad value fails before the model loads
    tp, device = init_from_env(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer = load_checkpoint(path, need_tokenizer, device=device, dtype=dtype, tp=tp, **ids)
    apply_threads(resolve_threads(args.threads, small_model=is_small(model)))
    return model, tokenizer


def prompt_text(text: str, option: str = "--prompt") -> str:
    """``text`` as given on the command line, refused if its bytes were not UTF-8
    (:func:`~dlm_toolkit.config.utf8_argument`)."""
    return utf8_argument(text, option)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None


def quiet_mlflow(verbose: bool = False) -> None:
    """Keep MLflow from printing its two emoji links (run, experiment) each time a run against a
    tracking server ends -- two lines per trial in a sweep; the commands print their own. Set in the
    environment, so worker processes started later inherit it; ``verbose`` brings the links back, and
    a value the user exported is left alone."""
    if verbose:
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "false"
    else:
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def add_task_args(p: argparse.ArgumentParser) -> None:
    """How a task reads its data and formats its prompts: ``--data``, ``--chat``, ``--system``,
    ``--gen-length``, ``--unsafe-exec`` (see :func:`task_options`)."""
    g = p.add_argument_group("task data and prompts")
    g.add_argument("--data", help="benchmark tasks: the data file or folder (default: $DLM_DATA_DIR or ./data)")
    g.add_argument("--chat", default="auto", choices=("auto", "true", "false"),
                   help="format prompts with the checkpoint's chat template: auto (when it has one; default), true, false")
    g.add_argument("--system", help="a system turn before each prompt (chat template only)")
    g.add_argument("--gen-length", type=int, help="generation budget in tokens (default: the task's)")
    g.add_argument("--unsafe-exec", action="store_true",
                   help="code tasks (humaneval, mbpp, humaneval_plus, mbpp_plus, livecodebench): where the bubblewrap sandbox is "
                        "unavailable, run generated code with process-level limits only (default: refuse)")
    g.add_argument("--task-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="another option of the task's constructor, repeatable (VALUE read as JSON where it parses, "
                        "else as text): e.g. livecodebench release_version=release_v5 start_date=2024-08-01, "
                        "bigcodebench split=instruct subset=hard hard_ids=FILE")


def task_options(args: argparse.Namespace) -> dict[str, Any]:
    """Constructor options of ``--task`` from :func:`add_task_args`' options, each refused for a
    task that does not take it."""
    from dlm_toolkit.tasks import TASKS, BenchmarkTask

    cls = TASKS.get(args.task)
    options: dict[str, Any] = {"chat": args.chat}
    if args.system is not None:
        options["system"] = args.system
    if args.data is not None:
        if cls is None or not issubclass(cls, BenchmarkTask):
            takers = sorted(k for k, c in TASKS.items() if issubclass(c, BenchmarkTask))
            raise ConfigError(f"--data: task '{args.task}' reads no data file (the benchmarks do: {', '.join(takers)})")
        options["data"] = args.data
    if args.gen_length is not None:
        if args.gen_length <= 0:
            raise ConfigError(f"--gen-length: must be >= 1 (got {args.gen_length})")
        options["answer_length"] = args.gen_length
    for key in ("unsafe_exec", "allow_import"):  # privileges: only these flags grant them
        if getattr(args, key, False) and cls is not None and key in inspect.signature(cls).parameters:
            options[key] = True
    options.update(parse_task_args(getattr(args, "task_arg", []) or []))
    return options


# options a --task-arg may not set: each has its own flag (unsafe_exec and allow_import are privileges, granted
# by the flag a person types, never by a KEY=VALUE that a script or a copied command line could carry along)
OWN_FLAGS = {"data": "--data", "chat": "--chat", "system": "--system", "answer_length": "--gen-length",
             "unsafe_exec": "--unsafe-exec", "allow_import": "--allow-import"}


def parse_task_args(items: list[str]) -> dict[str, Any]:
    """``--task-arg KEY=VALUE`` items as constructor options: VALUE as JSON where it parses (numbers,
    true/false/null, quoted text, lists), else as the text itself (``release_v5``, ``2024-08-01``).

    Raises:
        ConfigError: one line for an item without ``=``, a key that is not a Python name, a key given
            twice, or one that its own flag sets (named).
    """
    import json

    options: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ConfigError(f"--task-arg: expected KEY=VALUE with KEY an option name (got {item!r})")
        if key in OWN_FLAGS:
            raise ConfigError(f"--task-arg: {key} has its own flag: pass {OWN_FLAGS[key]}")
        if key in options:
            raise ConfigError(f"--task-arg: {key} given twice")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    return options
