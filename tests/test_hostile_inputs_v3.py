"""The fourth hostile table (issue 42 items 1, 5, 9; issue 45 item 5): lm-eval task folders that a
file or a store asks for, code-task options of the wrong type or range, and the rest of the earlier
table. Every row: exit 2 (or a ConfigError), one line naming the option and what is allowed, before
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
    "timeout a mapping": ({"timeout_s": {"a": 1}}, "timeout_s: must be a number > 0 and <= 3600 (seconds) (got {'a': 1})"),
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


# ----------------------------------------------------------------------------------------------- the rest (42.9)
from dlm_toolkit.strategy.registry import BLOCKS  # noqa: E402


class _TooWide(BLOCKS.get("dsb")):
    """Proposes a first block one position wider than its window (max_block_length 8)."""
    def first_bounds(self, state):
        lo, _ = super().first_bounds(state)
        return lo, lo + 9


class _JustWide(BLOCKS.get("dsb")):
    """Near miss: exactly the window."""
    def first_bounds(self, state):
        lo, _ = super().first_bounds(state)
        return lo, lo + 8


class _MovesBack(BLOCKS.get("dsb")):
    """Moves the block's start back by one after a step (positions before it are final)."""
    def next_bounds(self, state, ctx):
        lo, hi = super().next_bounds(state, ctx)
        back = (lo > state.block_lo) & (state.block_lo > state.prompt_len)  # a second move: one back instead
        return torch.where(back, state.block_lo - 1, lo), torch.where(back, state.block_lo + 1, hi)


import torch  # noqa: E402


@pytest.mark.parametrize("cls,needle", [
    ("_TooWide", r"proposed the active block \[5, 14\) for batch row 0, which is 9 wide, more than the window "
                 r"\(max_block_length 8\)"),
    ("_MovesBack", r"which moved back before the previous block's start \d+ \(the positions before that are final\)"),
])
def test_a_dynamic_block_wider_than_its_window_or_moving_back_is_refused(cls, needle):
    from dlm_toolkit import DecodingPolicy, StrategyError, decode
    from dlm_toolkit.testing import tiny_llada2

    def policy(name):
        return DecodingPolicy({"m2t": {"name": "threshold"}, "blocks": {
            "name": f"{__name__}:{name}", "params": {"block_length": 4, "max_block_length": 8}}})

    with pytest.raises(StrategyError, match=needle) as err:
        decode(tiny_llada2(seed=1), [[1, 2, 3, 4, 5]], policy(cls), 12)
    assert "\n" not in str(err.value)
    assert decode(tiny_llada2(seed=1), [[1, 2, 3, 4, 5]], policy("_JustWide"), 12).forward_calls > 0  # near miss


# lm-eval model_args: one line naming the key (the model is never loaded for a bad one)
MODEL_ARG_ROWS = {
    "presett": ("presett=llada2.1-q", "unknown key 'presett'; did you mean preset?"),
    "kv_cahce": ("kv_cahce=false", "unknown key 'kv_cahce'; did you mean kv_cache?"),
    "kv_cache no": ("kv_cache=no", "model_args kv_cache: must be true or false (got 'no')"),
    "kv_cache 1": ("kv_cache=1", "model_args kv_cache: must be true or false (got 1)"),
    "batch_size abc": ("batch_size=abc", "model_args batch_size: must be an integer in [1, 65536] (got 'abc')"),
    "batch_size 0": ("batch_size=0", "model_args batch_size: must be an integer in [1, 65536] (got 0)"),
    "seed x": ("seed=x", "model_args seed: must be an integer in [0, 9223372036854775807] (got 'x')"),
    "seed -1": ("seed=-1", "model_args seed: must be an integer in [0,"),
    "stop_every 0": ("stop_every=0", "model_args stop_every: must be an integer in [1,"),
}


@pytest.mark.parametrize("row", sorted(MODEL_ARG_ROWS))
def test_lm_eval_model_args_are_checked(row):
    from dlm_toolkit.integrations.lm_eval import DlmLM

    arg, needle = MODEL_ARG_ROWS[row]
    with pytest.raises(ConfigError) as err:
        DlmLM.create_from_arg_string(f"checkpoint={TESTBED},{arg}")
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("path", ["/dev/zero", "{tmp}/nowhere", "{tmp}/file"])
def test_lm_eval_checkpoint_that_is_not_a_folder(path, tmp_path):
    from dlm_toolkit.integrations.lm_eval import DlmLM

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="model_args checkpoint: .* is not a checkpoint folder"):
        DlmLM.create_from_arg_string(f"pretrained={path.format(tmp=tmp_path)}")


@pytest.fixture(scope="module")
def lm():
    """Near miss of every row above: the right keys and types load the model (lm-eval's own
    ``--batch_size`` arrives as text)."""
    from dlm_toolkit.integrations.lm_eval import DlmLM

    model = DlmLM.create_from_arg_string(f"pretrained={TESTBED},preset=llada2.1-q,kv_cache=false,seed=3,"
                                         "stop_every=2,mc_num=8,mc_batch_size=3", {"batch_size": "4", "device": None})
    assert (model.kv_cache, model.seed, model.stop_every, model.batch_size) == (False, 3, 2, 4)
    return model


def _requests(pairs):
    from lm_eval.api.instance import Instance as Request

    return [Request("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def test_loglikelihood_states_its_cost_and_shows_progress(lm, capsys):
    """mc_num 8 in batches of 3: three forwards per estimate, said before the first one; the bar
    counts samples (16 for two requests, the exact one-token case included)."""
    out = lm.loglikelihood(_requests([("12+3=", "15\n"), ("1+2=", "3")]))
    assert len(out) == 2
    err = capsys.readouterr().err
    assert "dlm loglikelihood: 2 request(s), 2 estimate(s) of mc_num 8 samples: up to 6 forwards of up to 3 rows" in err
    assert "16/16" in err


def test_rolling_loglikelihood_states_its_cost(lm, capsys):
    from lm_eval.api.instance import Instance as Request

    text = "1+2=3\n" * 40  # 240 characters: two windows of half the 256-position context
    out = lm.loglikelihood_rolling([Request("loglikelihood_rolling", {}, (text,), 0)])
    assert len(out) == 1
    err = capsys.readouterr().err
    assert "dlm loglikelihood_rolling: 1 request(s), 2 estimate(s) of mc_num 8 samples" in err and "16/16" in err


def test_a_huge_lm_eval_request_is_refused_before_tokenizing():
    from dlm_toolkit.integrations.lm_eval import encode_text
    from dlm_toolkit.tasks.base import MAX_PROMPT_CHARS

    with pytest.raises(ConfigError, match=f"an lm-eval request: a prompt of {MAX_PROMPT_CHARS + 1} characters"):
        encode_text(None, "x" * (MAX_PROMPT_CHARS + 1))  # the tokenizer is never reached


def test_a_huge_question_is_refused_before_tokenizing(tmp_path, capsys):
    """A question past the bound: one line naming the task and the record, not a Rust abort. Near
    miss: a prompt of exactly the bound passes the check."""
    from dlm_toolkit.tasks.base import MAX_PROMPT_CHARS, check_prompt_length

    frame = len("Question: \nAnswer:")
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "1" * (MAX_PROMPT_CHARS + 1 - frame), "answer": "so #### 3"}) + "\n")
    line = run_cli(["eval", "--checkpoint", str(TESTBED), "--task", "gsm8k", "--data", str(data), "--n", "1",
                    "--chat", "false", "--no-progress"], capsys, tmp_path)
    assert f"task 'gsm8k', instance 0: a prompt of {MAX_PROMPT_CHARS + 1} characters, more than" in line, line
    check_prompt_length("1" * MAX_PROMPT_CHARS, "near miss")


@pytest.mark.parametrize("final,refused", [("NaN", True), ("nan", True), ("inf", True), ("3 apples", True),
                                           ("", True), ("1,234", False), ("-7", False), ("2.5", False)])
def test_gsm8k_final_answers_are_numbers(final, refused, tmp_path):
    from dlm_toolkit.tasks import DataError, get_task

    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "ok"}) + "\n" +
                    json.dumps({"question": "q", "answer": f"steps\n#### {final}"}) + "\n")
    data.write_text(data.read_text().replace('"ok"', '"#### 1"'))
    if refused:
        with pytest.raises(DataError, match=r"record 1: 'answer' ends in '#### .*', not a number"):
            get_task("gsm8k", data=str(data))
    else:
        assert get_task("gsm8k", data=str(data)).eval_size == 2


@pytest.mark.parametrize("value", ["NaN", "-inf", "Infinity"])
def test_gsm_plus_answers_are_finite(value, tmp_path):
    from dlm_toolkit.tasks import DataError, get_task

    data = tmp_path / "gsmplus_testmini.jsonl"
    rows = [{"question": "q", "answer": "3", "perturbation_type": "x"},
            {"question": "q", "answer": value, "perturbation_type": "x"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="record 1: 'answer' .* is not a finite number"):
        get_task("gsm_plus", data=str(data))
    data.write_text(json.dumps(rows[0]) + "\n")
    assert get_task("gsm_plus", data=str(data)).eval_size == 1  # near miss


@pytest.mark.parametrize("eos,refused", [(12, True), ({"x": 1}, True), ({"content": 5}, True), (None, False),
                                         ({"content": "<|endoftext|>"}, False)])
def test_an_official_style_eos_token_of_the_wrong_type(eos, refused, tmp_path, capsys):
    """A checkpoint whose config.json names no special ids (as the released ones): the EOS token is
    read from tokenizer_config.json, which must name it as text (or the added-token form)."""
    from test_hostile_cli import make

    d = make(tmp_path, "ckpt", src=TESTBED,
             config=lambda c: {k: v for k, v in c.items() if k not in ("eos_token_id", "mask_token_id")})
    tc = json.loads((d / "tokenizer_config.json").read_text())
    if eos is not None:
        tc["eos_token"] = eos
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    args = ["decode", "--checkpoint", str(d), "--prompt", "1+2=", "--gen-length", "4"]
    if refused:
        line = run_cli(args, capsys, tmp_path)
        assert "tokenizer_config.json: eos_token must be a token's text or {\"content\": text}" in line, line
    else:
        assert main(args) == 0


@pytest.mark.parametrize("value,refused", [(10**18, True), ((1 << 20) + 1, True), (1 << 20, False)])
def test_max_position_embeddings_is_bounded(value, refused, tmp_path, capsys):
    from test_hostile_cli import IDS, make

    d = make(tmp_path, "ckpt", config=lambda c: {**c, "max_position_embeddings": value})
    args = ["decode", "--checkpoint", str(d), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS]
    if refused:
        line = run_cli(args, capsys, tmp_path)
        assert "max_position_embeddings" in line and "1048576" in line, line
    else:
        assert main(args) == 0


def test_an_exhausted_uid_pool_is_one_line(tmp_path, monkeypatch):
    """Every sandbox uid leased (by this test, in a lock folder of its own so that nothing else on the
    machine is starved): the code task's run ends in a ConfigError -- one line from ``dlm`` --, and
    with two uids freed the same run goes through."""
    import fcntl
    import os

    from dlm_toolkit.tasks import get_task
    from dlm_toolkit.tasks.sandbox import limits

    if os.geteuid() != 0:
        pytest.skip("uids are leased only by a root evaluator")  # the CI machine runs as root
    task = get_task("mbpp", data=str(BENCH / "mbpp"), timeout_s=20.0)  # probes the sandbox: before the pool is full
    inst = task.instances(1, 0, "eval")[0]
    assert task.run(inst, inst.reference).passed  # near miss first (and the runner's own probe, cached)
    folder = tmp_path / "uids"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(limits, "lock_dir", lambda: folder)
    held = {}
    for uid in range(limits.POOL_FIRST, limits.POOL_FIRST + limits.POOL_SIZE):
        held[uid] = os.open(folder / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(held[uid], fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(ConfigError, match=r"all 1000 sandbox uids .* are in use by other sandboxed runs"):
            task.run(inst, inst.reference)
        for uid in sorted(set(held) - limits._reserved())[:2]:  # a run takes two: the candidate's and the tests'
            os.close(held.pop(uid))
        assert task.run(inst, inst.reference).passed
    finally:
        for fd in held.values():
            os.close(fd)
