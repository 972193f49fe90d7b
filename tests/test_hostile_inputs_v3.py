"""The fourth hostile table (issue 42 items 1 and 5; issue 45 item 5): lm-eval task folders that a
file or a store asks for, code-task options of the wrong type or range, hints that name what works
(the rest of issue 42 item 9: ``test_hostile_inputs_v3_rest.py``). Every row: exit 2 (or a ConfigError), one line naming the option and what is allowed, before
any work, and a near miss next to it still accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import sweep_helpers as h
from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from test_hostile_cli import TESTBED, run_cli
from test_hostile_inputs import no_hang, settings_with, store_template  # noqa: F401  (fixtures)

BENCH = Path(__file__).resolve().parent / "fixtures" / "benchmarks"

# ----------------------------------------------------------------------------------------------- lm-eval imports
T_YAML = """task: dlm_trap
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{reference}}}}"
process_results: !function utils.f
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

UTILS = """from pathlib import Path
Path({marker!r}).write_text("imported")


def f(doc, results):
    return {{"exact_match": float(results[0].strip() == doc["reference"])}}
"""


@pytest.fixture
def trap(tmp_path) -> tuple[Path, Path]:
    """``(DIR, MARKER)``: ``DIR/dlm_trap.yaml`` says ``process_results: !function utils.f``, and
    ``DIR/utils.py`` writes ``MARKER`` when it is imported."""
    folder, marker = tmp_path / "tasks", tmp_path / "marker"
    folder.mkdir()
    (folder / "data.jsonl").write_text(json.dumps({"prompt": "1+2=", "reference": "3"}) + "\n")
    (folder / "dlm_trap.yaml").write_text(T_YAML.format(data=folder / "data.jsonl"))
    (folder / "utils.py").write_text(UTILS.format(marker=str(marker)))
    return folder, marker


@pytest.mark.parametrize("top_level_grant", [False, True])
def test_an_experiment_file_cannot_make_lm_eval_import(trap, top_level_grant, tmp_path, capsys):
    """``include_path`` from an experiment file is refused naming the flag, whatever the file's own
    ``allow_import: true`` says (that names strategy classes; it grants no task files)."""
    folder, marker = trap
    exp = h.write_yaml(tmp_path / "exp.yaml", h.experiment(
        task="lm_eval", task_args={"task": "dlm_trap", "include_path": str(folder)}, allow_import=top_level_grant))
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/o.db", "--no-progress"], capsys, tmp_path)
    assert "task_args.include_path" in line and "--allow-import" in line, line
    assert not marker.exists()


@pytest.mark.parametrize("task_args,needle", [
    ({"task": "dlm_trap", "allow_import": True}, "task_args.allow_import: lets lm-eval import Python from files"),
    ({"task": "{folder}/dlm_trap.yaml"}, "is a file: lm-eval would import Python"),
])
def test_an_experiment_file_cannot_name_a_task_file_or_grant_itself(trap, task_args, needle, tmp_path, capsys):
    folder, marker = trap
    args = {k: v.format(folder=folder) if isinstance(v, str) else v for k, v in task_args.items()}
    exp = h.write_yaml(tmp_path / "exp.yaml", h.experiment(task="lm_eval", task_args=args))
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/o.db", "--no-progress"], capsys, tmp_path)
    assert needle in line and "--allow-import" in line, line
    assert not marker.exists()


def test_the_flag_grants_lm_eval_imports_to_a_sweep(trap):
    """Near miss: ``dlm sweep --allow-import`` (``load_experiment(allow_import=True)``) builds the task,
    and lm-eval imports the folder's Python."""
    from dlm_toolkit.sweep.experiment import load_experiment

    folder, marker = trap
    exp = load_experiment(h.experiment(task="lm_eval", task_args={"task": "dlm_trap", "include_path": str(folder)}),
                          allow_import=True)
    assert exp.task_args["allow_import"] is True and marker.read_text() == "imported"


def test_a_store_naming_a_task_folder_is_refused(trap, store_template, tmp_path, capsys):  # noqa: F811
    folder, marker = trap
    db = tmp_path / "optuna.db"
    shutil.copy(store_template, db)
    args = ["replay", "--trial", "0", "--storage", f"sqlite:///{db}", "--study-name", "s"]
    settings_with(task="lm_eval", task_args={"task": "dlm_trap", "include_path": str(folder)})(db)
    line = run_cli(args, capsys, tmp_path)
    assert "task_args.include_path" in line and "--allow-import" in line, line
    settings_with(task="lm_eval", task_args={"task": "dlm_trap", "include_path": str(folder), "allow_import": True})(db)
    line = run_cli(args, capsys, tmp_path)
    assert "stored task_args.allow_import" in line and "`dlm replay --allow-import`" in line, line
    assert not marker.exists()


def test_dlm_eval_with_the_flag_uses_the_folder(trap, capsys):
    """The user's own command line: refused without the flag, and with it the task's own
    ``process_results`` (the imported ``utils.f``) scores the decode."""
    folder, marker = trap
    args = ["eval", "--checkpoint", str(TESTBED), "--task", "lm_eval", "--task-arg", "task=dlm_trap",
            "--task-arg", f"include_path={folder}", "--n", "1", "--json", "--no-progress"]
    assert main(args) == 2
    assert "--allow-import" in capsys.readouterr().err and not marker.exists()
    assert main([*args, "--allow-import"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] == 1 and marker.read_text() == "imported"


def test_a_task_argument_cannot_grant_imports(capsys, tmp_path):
    line = run_cli(["eval", "--checkpoint", str(TESTBED), "--task", "lm_eval", "--task-arg", "task=x",
                    "--task-arg", "allow_import=true", "--n", "1"], capsys, tmp_path)
    assert "allow_import has its own flag: pass --allow-import" in line, line


# ----------------------------------------------------------------------------------------------- code-task options
FIX = Path(__file__).resolve().parent / "fixtures"
CODE_TASKS = {  # task -> its data option (the limits are checked before any file is read)
    "humaneval": {}, "mbpp": {"data": str(BENCH / "mbpp")}, "humaneval_plus": {"data": str(BENCH / "evalplus")},
    "mbpp_plus": {"data": str(BENCH / "evalplus")}, "livecodebench": {"data": str(FIX / "livecodebench")},
    "bigcodebench": {"data": str(FIX / "bigcodebench")},
}


def machine_half_mb() -> int:
    """Half of this machine's memory, read from /proc/meminfo (and the cgroup's limit where lower)."""
    total = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                     if ln.startswith("MemTotal:"))) * 1024
    for limit in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        if limit.exists() and limit.read_text().strip().isdigit():
            total = min(total, int(limit.read_text()))
    return total // 2 >> 20


OPTION_ROWS = {  # name -> (options, what the one line must say)
    "memory 1e13": ({"memory_mb": 10_000_000_000_000}, "memory_mb: must be an integer in [64, {half}]"),
    "memory past half the machine": ({"memory_mb": "{half+1}"}, "memory_mb: must be an integer in [64, {half}]"),
    "memory as text": ({"memory_mb": "512"}, "memory_mb: must be an integer in [64, {half}] (MiB; at most half of "
                       "this machine's memory) (got '512')"),
    "memory true": ({"memory_mb": True}, "memory_mb: must be an integer"),
    "memory 63": ({"memory_mb": 63}, "memory_mb: must be an integer in [64,"),
    "memory 512.0": ({"memory_mb": 512.0}, "memory_mb: must be an integer"),
    "timeout a mapping": ({"timeout_s": {"a": 1}},
                          "timeout_s: must be a number > 0 and <= 3600 (seconds) (got {'a': 1})"),
    "timeout true": ({"timeout_s": True}, "timeout_s: must be a number > 0 and <= 3600 (seconds) (got True)"),
    "timeout 1e309": ({"timeout_s": json.loads("1e309")}, "timeout_s: must be a number > 0 and <= 3600"),
    "timeout nan": ({"timeout_s": float("nan")}, "timeout_s: must be a number > 0"),
    "timeout 0": ({"timeout_s": 0}, "timeout_s: must be a number > 0"),
    "timeout 3600.5": ({"timeout_s": 3600.5}, "timeout_s: must be a number > 0 and <= 3600"),
    "timeout as text": ({"timeout_s": "5"}, "timeout_s: must be a number"),
}


def _fill(value, half):
    return int(value.format(**{"half+1": half + 1})) if isinstance(value, str) and "{" in value else value


@pytest.mark.parametrize("task", sorted(CODE_TASKS))
@pytest.mark.parametrize("row", sorted(OPTION_ROWS))
def test_code_task_limits_are_typed_and_bounded(task, row):
    from dlm_toolkit.tasks import get_task

    options, needle = OPTION_ROWS[row]
    half = machine_half_mb()
    options = {k: _fill(v, half) for k, v in options.items()}
    with pytest.raises(ConfigError) as err:
        get_task(task, **CODE_TASKS[task], **options)
    line = str(err.value)
    assert needle.replace("{half}", str(half)) in line and f"task '{task}'" in line and "\n" not in line, line


@pytest.mark.parametrize("value,needle", [(1e12, "max_test_mb: must be a number > 0 and <= 256 (MiB)"),
                                          (256.5, "<= 256"), (True, "max_test_mb"), ("1", "max_test_mb")])
def test_livecodebench_test_size_bound_cannot_be_lifted(value, needle):
    from dlm_toolkit.tasks import get_task

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        get_task("livecodebench", data=str(FIX / "livecodebench"), max_test_mb=value)


def test_the_edges_are_accepted():
    """Near misses: the largest memory this machine allows, 64 MiB, 3600 s, an integer time and
    256 MiB of tests build the task."""
    from dlm_toolkit.tasks import get_task

    half = machine_half_mb()
    for options in ({"memory_mb": half, "timeout_s": 3600}, {"memory_mb": 64, "timeout_s": 0.001}):
        task = get_task("humaneval", **options)
        assert (task.memory_mb, task.timeout_s) == (options["memory_mb"], float(options["timeout_s"]))
    assert get_task("mbpp", data=str(BENCH / "mbpp"), memory_mb=half).memory_mb == half
    lcb = get_task("livecodebench", data=str(FIX / "livecodebench"), release_version="release_v2", max_test_mb=256)
    assert lcb.max_test_bytes == 256 << 20


def test_bigcodebench_default_memory_is_lowered_on_a_small_machine(capsys):
    """The official 30 GiB cannot protect a machine with less than 60 GiB: the default becomes half
    of this machine's memory, and the task says so."""
    from dlm_toolkit.tasks.code import code_limits

    half = machine_half_mb()
    limits = code_limits("bigcodebench", timeout_s=240, memory_mb=None, default_memory_mb=30 * 1024)
    assert limits.memory_mb == min(30 * 1024, half)
    note = capsys.readouterr().err
    if half < 30 * 1024:  # this machine (23 GiB here): lowered, and said
        assert f"bigcodebench: memory_mb {half} (the default 30720 lowered to half of this machine's memory" in note
    assert code_limits("bigcodebench", timeout_s=240, memory_mb=None, default_memory_mb=64).memory_mb == 64
    assert capsys.readouterr().err == ""  # a default within the machine is kept, silently


def test_plus_must_be_a_bool():
    from dlm_toolkit.tasks import get_task

    with pytest.raises(ConfigError, match="plus: must be true or false"):
        get_task("mbpp_plus", data=str(BENCH / "evalplus"), plus="no")


# ----------------------------------------------------------------------------------------------- hints (issue 45.5)
def test_the_no_bubblewrap_refusal_names_the_flag_that_works():
    """The refusal used to suggest the task argument ``unsafe_exec: true``, which is refused
    everywhere: it names only the command-line flag now."""
    import dataclasses

    from dlm_toolkit.tasks.sandbox import SandboxUnavailable, check_isolation, sandbox_info

    info = dataclasses.replace(sandbox_info(), bwrap=None, bwrap_problem="bwrap: not found")
    with pytest.raises(SandboxUnavailable) as err:
        check_isolation(False, info=info)
    line = str(err.value)
    assert "pass --unsafe-exec on the command line" in line and "bwrap: not found" in line
    assert "unsafe_exec: true" not in line and "\n" not in line


def test_pyproject_extra_and_the_modules_it_provides_agree():
    """``EXTRA_MODULES`` is what the ``bigcodebench`` extra installs: each module is its distribution's
    name or, for one installed here, an import name its metadata lists (``bs4`` of beautifulsoup4);
    each distribution of the extra contributes one."""
    import tomllib
    from importlib.metadata import packages_distributions

    from dlm_toolkit.tasks.bigcodebench import EXTRA_MODULES

    extra = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    dists = {r.split("==")[0].lower() for r in extra["project"]["optional-dependencies"]["bigcodebench"]}
    installed = {m: {d.lower() for d in ds} for m, ds in packages_distributions().items()}

    def sources(module: str) -> set[str]:
        return ({module.lower()} | installed.get(module, set())) & dists

    assert all(sources(m) for m in EXTRA_MODULES), sorted(m for m in EXTRA_MODULES if not sources(m))
    assert set().union(*map(sources, EXTRA_MODULES)) == dists


@pytest.mark.parametrize("missing,wanted,unwanted", [
    ({"BigCodeBench/1": ["scipy"]}, "pip install 'dlm-toolkit[bigcodebench]' provides scipy", "lacks"),
    ({"BigCodeBench/1": ["dlm_absent"]}, "the sandbox interpreter lacks dlm_absent (no extra of dlm-toolkit provides "
                                         "it): install it into that environment", "pip install"),
    ({"BigCodeBench/1": ["scipy", "dlm_absent"], "BigCodeBench/2": ["dlm_absent"]},
     "pip install 'dlm-toolkit[bigcodebench]' provides scipy; the sandbox interpreter lacks dlm_absent", None),
])
def test_env_missing_suggests_the_extra_only_for_what_it_provides(missing, wanted, unwanted):
    from types import SimpleNamespace

    from dlm_toolkit.tasks.bigcodebench import BigCodeBenchTask
    from dlm_toolkit.tasks.unittest_box import LibraryEnv

    state = SimpleNamespace(env_missing=missing, env=LibraryEnv(python="/opt/py/bin/python3"))
    line = BigCodeBenchTask.env_report(state)
    assert wanted in line and "(/opt/py/bin/python3)" in line and "\n" not in line, line
    assert unwanted is None or unwanted not in line, line
