"""The third hostile table (issue 35, inputs): privileges a file asks for, chat templates that loop
or explode, benchmark data files that are deep, special or mistyped, plug-in budgets past any
bound, and config values of the wrong type or range. Every row: exit 2 (or a ConfigError), one
line naming the field or the file, nothing written, and a near-miss next to it still accepted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import sweep_helpers as h
from dlm_toolkit.models import chat
from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from test_hostile_cli import TESTBED, run_cli
from test_hostile_inputs import no_hang, settings_with, store_template  # noqa: F401  (fixtures: a hung row fails)

BENCH = Path(__file__).resolve().parent / "fixtures" / "benchmarks"


# ----------------------------------------------------------------------------------------------- privileges
def test_an_experiment_file_cannot_grant_unsafe_exec(tmp_path, capsys):
    exp = h.write_yaml(tmp_path / "exp.yaml", h.experiment(task="mbpp", task_args={
        "data": str(BENCH / "mbpp"), "unsafe_exec": False}))
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/o.db", "--no-progress"], capsys, tmp_path)
    assert "exp.yaml: task_args.unsafe_exec:" in line and "`dlm sweep --unsafe-exec`" in line, line


def test_the_flag_grants_it():
    """Near miss: the same experiment without the key loads; ``--unsafe-exec`` puts it in the task's
    arguments (a code task only)."""
    from dlm_toolkit.sweep.experiment import load_experiment

    data = h.experiment(task="mbpp", task_args={"data": str(BENCH / "mbpp")})
    plain, granted = load_experiment(data), load_experiment(data, unsafe_exec=True)
    assert "unsafe_exec" not in plain.task_args and granted.task_args["unsafe_exec"] is True
    assert "unsafe_exec" not in load_experiment(h.experiment(), unsafe_exec=True).task_args  # add takes no code


def test_a_store_asking_for_unsafe_exec_is_refused_naming_the_flag(store_template, tmp_path, capsys):  # noqa: F811
    db = tmp_path / "optuna.db"
    shutil.copy(store_template, db)
    settings_with(task="mbpp", task_args={"data": str(tmp_path / "missing.json"), "unsafe_exec": True})(db)
    args = ["replay", "--trial", "0", "--storage", f"sqlite:///{db}", "--study-name", "s"]
    line = run_cli(args, capsys, tmp_path)
    assert "stored task_args.unsafe_exec" in line and "`dlm replay --unsafe-exec`" in line, line
    # with the flag the privilege check passes: the replay goes on to the (missing) data file
    line = run_cli([*args, "--unsafe-exec"], capsys, tmp_path)
    assert "no data file" in line and "missing.json" in line, line


# ----------------------------------------------------------------------------------------------- chat templates
@pytest.fixture
def templated(tmp_path):
    """The testbed checkpoint with a ``chat_template.jinja`` the test writes."""
    folder = tmp_path / "ckpt"
    shutil.copytree(TESTBED, folder)

    def write(template: str) -> Path:
        (folder / "chat_template.jinja").write_text(template)
        return folder
    return write


@pytest.fixture
def quick_bounds(monkeypatch):
    monkeypatch.setattr(chat._RENDERER, "timeout_s", 2.0)
    monkeypatch.setattr(chat._RENDERER, "memory_mb", 256)
    monkeypatch.setattr(chat._RENDERER, "max_bytes", 1000)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
DECODE = ["decode", "--prompt", "1+1=", "--gen-length", "4", "--threads", "1"]
EVAL = ["eval", "--task", "add", "--n", "2", "--no-progress", "--threads", "1"]


@pytest.mark.parametrize("template, command, needle", [
    (LOOP, [*DECODE, "--chat"], "did not finish rendering within 2 s"),
    (LOOP, EVAL, "did not finish rendering within 2 s"),  # --chat auto: the template is used
    ("{{ 'x' * 1100000000 }}", EVAL, "needs more than 256 MiB of memory"),
    ("{{ 'x' * 1001 }}", [*DECODE, "--chat"], "renders 1001 bytes, more than the 1000"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", [*DECODE, "--chat"], "RecursionError"),
])
def test_a_hostile_chat_template_is_one_line_naming_its_file(template, command, needle, templated, quick_bounds,
                                                             tmp_path, capsys):
    folder = templated(template)
    line = run_cli([*command, "--checkpoint", str(folder)], capsys, tmp_path)
    assert f"{folder / 'chat_template.jinja'}: chat template" in line and needle in line, line
    assert chat._RENDERER._proc is None  # the renderer that ran it was killed


def test_a_template_at_the_bounds_renders_and_gives_transformers_ids(templated, quick_bounds, capsys):
    """Near misses: 1000 bytes (the cap) and 90,000 loop steps render; the renderer survives a refusal
    (the next prompt starts a fresh child) and its ids are transformers' own."""
    from transformers import AutoTokenizer

    from dlm_toolkit.models.tokenizer import find_tokenizer

    folder = templated("{{ 'x' * 1001 }}")
    with pytest.raises(ConfigError, match="renders 1001 bytes"):
        chat.chat_text(find_tokenizer(folder), chat.messages_for("q"))
    folder = templated("{{ 'y' * (1000 - messages[0].content | length) }}{{ messages[0].content }}")
    assert chat.chat_text(find_tokenizer(folder), chat.messages_for("1+1=")) == "y" * 996 + "1+1="
    folder = templated("{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}"
                       "({{ messages[0].content }})")
    tok = find_tokenizer(folder)
    assert chat.chat_text(tok, chat.messages_for("1+1=")) == "(1+1=)"
    pid = chat._RENDERER._proc.pid
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert chat.chat_ids(tok, chat.messages_for("1+1=")) == \
        list(reference.apply_chat_template(chat.messages_for("1+1="), add_generation_prompt=True)["input_ids"])
    assert main([*DECODE, "--chat", "--checkpoint", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"]
    chat._RENDERER.close()
    assert not _alive(pid)


# ----------------------------------------------------------------------------------------------- benchmark data
def _mbpp_records() -> list[dict]:
    return json.loads((BENCH / "mbpp" / "sanitized-mbpp.json").read_text())


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _evalplus_rows() -> list[dict]:
    return [json.loads(line) for line in (BENCH / "evalplus" / "HumanEvalPlus.jsonl").read_text().splitlines() if line]


def _mbpp_with(tmp_path: Path, index: int, **changes) -> Path:
    records = _mbpp_records()
    records[index].update(changes)
    path = tmp_path / "sanitized-mbpp.json"
    path.write_text(json.dumps(records, indent=1))  # one field per line: record 1 starts on a known line
    return path


def _record_line(path: Path, index: int) -> int:
    """The line record ``index`` starts on, found independently: the index-th '{' at nesting depth 1
    of the pretty-printed array."""
    depth, seen = 0, -1
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for c in line:
            if c == "{" and depth == 1:
                seen += 1
                if seen == index:
                    return number
            depth += c in "[{"
            depth -= c in "]}"
    raise AssertionError("no such record")


@pytest.mark.parametrize("field, value, needle", [
    ("test_imports", "import math", "field 'test_imports': Input should be a valid list (got str 'import math')"),
    ("test_imports", ["import math", 3], "field 'test_imports.1': Input should be a valid string (got int 3)"),
    ("test_list", "assert f(1) == 1", "field 'test_list': Input should be a valid list"),
    ("test_list", [], "field 'test_list': List should have at least 1 item"),
    ("task_id", "12", "field 'task_id': Input should be a valid integer (got str '12')"),
    ("code", None, "field 'code': Input should be a valid string (got NoneType None)"),
])
def test_a_mistyped_mbpp_row_is_one_line_naming_file_and_line(field, value, needle, tmp_path, capsys):
    path = _mbpp_with(tmp_path, 1, **{field: value})
    line = run_cli(["eval", "--checkpoint", str(TESTBED), "--task", "mbpp", "--n", "2", "--data", str(path),
                    "--unsafe-exec"], capsys, tmp_path)
    assert f"{path}:{_record_line(path, 1)}: record 1: {needle}" in line, line


def test_mbpp_test_imports_as_a_list_is_read_and_the_reference_passes(tmp_path):
    """Near miss: the same record with ``test_imports`` a list of one import reads, and its
    reference solution passes (the imports are lines of code, not characters)."""
    from dlm_toolkit.tasks import get_task

    records = _mbpp_records()
    i = next(k for k, r in enumerate(records) if 11 <= r["task_id"] <= 510)
    path = _mbpp_with(tmp_path, i, test_imports=["import math"])
    task = get_task("mbpp", data=str(path), unsafe_exec=True)
    inst = next(x for x in task.instances(1000, 0, "eval") if x.meta["task_id"] == records[i]["task_id"])
    assert inst.meta["tests"].splitlines()[0] == "import math"
    assert task.score(inst, f"```python\n{inst.reference}\n```") == 1.0


EVALPLUS_ROWS = {  # field -> (value, what the line must say)
    "plus_input": ("[[1], 2]", "field 'plus_input.1': Input should be a valid list (got int 2)"),
    "base_input": ('"abc"', "field 'base_input': Input should be a valid list (got str 'abc')"),
    "atol": ("-1", "field 'atol': Input should be greater than or equal to 0"),
    "entry_point": ("7", "field 'entry_point': Input should be a valid string (got int 7)"),
}


@pytest.mark.parametrize("field", sorted(EVALPLUS_ROWS))
def test_a_mistyped_evalplus_row_names_file_and_line(field, tmp_path):
    from dlm_toolkit.tasks import get_task
    from dlm_toolkit.tasks.data import DataError

    rows = _evalplus_rows()
    text, needle = EVALPLUS_ROWS[field]
    lines = [json.dumps(r) for r in rows]
    lines[1] = json.dumps({**rows[1], field: json.loads(text)})
    path = tmp_path / "HumanEvalPlus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        get_task("humaneval_plus", data=str(path), unsafe_exec=True)
    assert str(err.value) == f"{path}:2: {needle}" or str(err.value).startswith(f"{path}:2: {needle}"), err.value
    lines[1] = json.dumps({**rows[1], "atol": 0.5})  # near miss: a finite tolerance >= 0
    path.write_text("\n".join(lines) + "\n")
    assert get_task("humaneval_plus", data=str(path), unsafe_exec=True).eval_size == len(rows)


DEEP_LINE = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("task, name, content, needle", [
    ("gsm8k", "test.jsonl", '{"question": "q", "answer": "#### 1"}\n' + DEEP_LINE + "\n",
     "test.jsonl:2: JSON nested 100000 levels deep; at most 64"),
    ("mbpp", "sanitized-mbpp.json", DEEP_LINE, "sanitized-mbpp.json: JSON nested 100000 levels deep"),
    ("math500", "test.jsonl", '{"problem": "p", "answer": NaN}\n', "test.jsonl:1: field 'answer"),
    ("gsm8k", "test.jsonl", '{"question": ["q"], "answer": "#### 1"}\n', "field 'question': Input should be a valid string"),
])
def test_deep_and_mistyped_data_lines_are_one_line(task, name, content, needle, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(content)
    line = run_cli(["eval", "--checkpoint", str(TESTBED), "--task", task, "--n", "2", "--data", str(path)],
                   capsys, tmp_path)
    assert needle in line and "Traceback" not in line, line


def test_a_64_deep_answer_is_still_read(tmp_path):
    """Near miss of the depth bound: a record nested 64 levels deep in all is read (and refused
    only for its type), 65 is refused as too deep."""
    from dlm_toolkit.tasks import get_task
    from dlm_toolkit.tasks.data import DataError

    path = tmp_path / "test.jsonl"
    for depth, needle in ((64, r"field 'answer': Input should be a valid string \(got list"), (65, "nested 65 levels deep")):
        path.write_text('{"problem": "p", "answer": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}\n")
        with pytest.raises(DataError, match=needle):
            get_task("math500", data=str(path))


@pytest.mark.parametrize("kind", ["fifo", "pagemap", "zero", "folder_fifo"])
def test_special_data_files_are_refused_by_name(kind, tmp_path, capsys):
    if kind == "pagemap":
        path, needle = Path("/proc/self/pagemap"), "/proc/self/pagemap: a benchmark data file of size 0"
    elif kind == "zero":
        path, needle = Path("/dev/zero"), "/dev/zero: task 'gsm8k''s data file must be a regular file, this is a character device"
    else:
        folder = tmp_path / "d"
        folder.mkdir()
        path = folder / "test.jsonl" if kind == "folder_fifo" else tmp_path / "data.jsonl"
        os.mkfifo(path)
        needle = f"{path}: task 'gsm8k''s data file must be a regular file, this is a FIFO"
        path = folder if kind == "folder_fifo" else path  # a folder holding the official name as a FIFO
    line = run_cli(["eval", "--checkpoint", str(TESTBED), "--task", "gsm8k", "--n", "2", "--data", str(path)],
                   capsys, tmp_path)
    assert needle in line and "no data file" not in line, line


def test_long_plus_input_lists_have_a_time_bound(tmp_path, monkeypatch):
    """300,000 plus inputs: the reference outputs are computed in chunks against a per-problem bound
    (lowered here); the problem next to it, with its three inputs, still scores its reference 1."""
    from dlm_toolkit.tasks import get_task
    from dlm_toolkit.tasks.data import DataError
    from dlm_toolkit.tasks.mbpp import REFERENCE_CHUNK, HumanEvalPlusTask

    rows = _evalplus_rows()
    rows[1] = {**rows[1], "plus_input": [list(rows[1]["base_input"][0])] * 300_000}
    path = _jsonl(tmp_path / "HumanEvalPlus.jsonl", rows)
    monkeypatch.setattr(HumanEvalPlusTask, "reference_budget_s", 0.0)
    task = get_task("humaneval_plus", data=str(path), unsafe_exec=True)
    by_id = {i.meta["task_id"]: i for i in task.instances(1000, 0, "eval")}
    small, big = by_id[rows[0]["task_id"]], by_id[rows[1]["task_id"]]
    with pytest.raises(DataError, match=rf"{rows[1]['task_id']}: the canonical solution's outputs on "
                                        rf"{300_000 + len(rows[1]['base_input'])} inputs took more than 0 s "
                                        rf"\({REFERENCE_CHUNK} done\)"):
        task.tests(big)
    assert len(small.meta["base_input"]) + len(small.meta["plus_input"]) <= REFERENCE_CHUNK
    assert task.score(small, small.reference) == 1.0  # one run: bounded by its own timeout, not the budget


# ----------------------------------------------------------------------------------------------- plug-in budgets
def _deleting_rule(declared):
    """An Indel plug-in that deletes the first written generated token of its block at every step
    (the block never fills) and declares ``declared`` forwards for it."""
    import torch

    from dlm_toolkit import T2T
    from dlm_toolkit.hooks.indel import indel_region, written_window

    class _DeletesEveryStep(T2T.get("indel")):
        def indel(self, ctx):
            region = indel_region(ctx) & (written_window(ctx) != ctx.mask_token_id)
            return torch.zeros_like(region), region & (region.long().cumsum(1) == 1)

        def max_indel_forwards(self, block_length):
            return declared

    name = f"_deletes_every_step_{abs(hash(repr(declared)))}"
    if name not in T2T.names():
        T2T.register(name)(_DeletesEveryStep)
    return name


def _policy(t2t: str):
    from dlm_toolkit import DecodingPolicy

    return DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "t2t.name": t2t})


CAP = 64 * 4 + 4096  # the engine's bound for a block of 4: 64 forwards per window position + 4096, by hand


@pytest.mark.parametrize("declared", [10**9, float("inf"), float("nan"), -1, CAP + 1, 2.0, True, "8"])
def test_an_absurd_indel_budget_is_refused_when_the_policy_is_built(declared):
    name = _deleting_rule(declared)
    with pytest.raises(ConfigError) as err:
        _policy(name)
    assert str(err.value) == (f"t2t rule '{name}': max_indel_forwards(4) = {declared!r}: must be an integer in "
                              f"[0, {CAP}], the engine's bound of 64 forwards per window position (4) + 4096")


def test_a_budget_at_the_cap_is_built_and_a_rule_past_its_budget_stops():
    """Near misses: the cap itself builds; a small honest budget on a rule that deletes every step
    ends the decode with one error naming the rule (it would otherwise never finish)."""
    from dlm_toolkit import StrategyError, decode
    from dlm_toolkit.testing import ScriptedLM, mixing_logits

    assert _policy(_deleting_rule(CAP)).t2t.max_indel_forwards(4) == CAP
    model = ScriptedLM(mixing_logits(24, seed=0, scale=2.5, mix=2.0), 24, 23, 22)
    # block 4 + max_post_steps 16 (llada2.1-q) + the 3 it declared
    with pytest.raises(StrategyError, match=r"block schedule 'semi_ar' exceeded 23 forwards in one block"):
        decode(model, [[1, 2, 3]], _policy(_deleting_rule(3)), 8)


def test_a_verifier_and_a_block_schedule_budget_are_capped_too():
    from dlm_toolkit import M2T, DecodingPolicy
    from dlm_toolkit.strategy.registry import REGISTRIES
    from strategies.blocks_semi_ar import SemiAutoregressive

    class _Greedy(M2T.get("s2d2")):
        def max_verify_forwards(self, block_length):
            return float("inf")

    class _Endless(SemiAutoregressive):
        def max_forwards_per_block(self):
            return 10**12

    for registry, name, cls in ((M2T, "_greedy_verifier", _Greedy), (REGISTRIES["blocks"], "_endless_blocks", _Endless)):
        if name not in registry.names():
            registry.register(name)(cls)
    with pytest.raises(ConfigError, match=r"m2t rule '_greedy_verifier': max_verify_forwards\(4\) = inf: must be an "
                                          r"integer in \[0, 4352\]"):
        DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "m2t.name": "_greedy_verifier"})
    with pytest.raises(ConfigError, match=r"blocks rule '_endless_blocks': max_forwards_per_block\(\) = 1000000000000"):
        DecodingPolicy("llada2.1-q", **{"blocks.name": "_endless_blocks", "blocks.params.block_length": 4})
    # the built-in bounds at their largest settings stay under the cap
    DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 1, "blocks.params.max_post_steps": 1024,
                                    "t2t.name": "indel", "t2t.params.indel_steps": 4096})


# ----------------------------------------------------------------------------------------------- config values
@pytest.mark.parametrize("text, needle", [
    ("name: a\nn: 8\nn: 100000\n", "exp.yaml:3: duplicate key 'n' (first on line 2)"),
    ("name: a\nsearch_space:\n  m2t.params.threshold: {float: [0.3, 0.9]}\n  m2t.params.threshold: {float: [0.1, 0.2]}\n",
     "exp.yaml:4: duplicate key 'm2t.params.threshold' (first on line 3)"),
    ("name: a\nsampler: {name: random, name: tpe}\n", "exp.yaml:2: duplicate key 'name' (first on line 2)"),
    ("name: a\nn: [1\n", "exp.yaml:3: not valid YAML ("),
])
def test_duplicate_yaml_keys_are_refused_naming_key_and_line(text, needle, tmp_path, capsys):
    exp = tmp_path / "exp.yaml"
    exp.write_text(text)
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/o.db", "--no-progress"], capsys, tmp_path)
    assert needle in line, line


def test_the_same_key_in_sibling_mappings_is_no_duplicate(tmp_path):
    """Near miss: ``name`` in the experiment, in its sampler and in each list item of a policy file;
    a key repeated in *different* mappings is fine."""
    from dlm_toolkit.config import read_mapping_file

    path = tmp_path / "ok.yaml"
    path.write_text("name: a\nsampler: {name: random}\npresets: [{name: x}, {name: y}]\nm2t:\n  name: threshold\n"
                    "  params: {threshold: 0.9}\nt2t: {name: none}\n")
    assert read_mapping_file(path)["presets"] == [{"name": "x"}, {"name": "y"}]
    policy = tmp_path / "p.yaml"
    policy.write_text("m2t: {name: threshold}\nm2t: {name: topk}\n")
    from dlm_toolkit.strategy.policy_config import load_policy

    with pytest.raises(ConfigError, match=r"p.yaml:2: duplicate key 'm2t' \(first on line 1\)"):
        load_policy(str(policy))


CONFIG_ROWS = {  # field -> (bad value, what the line names, a near-miss value that loads)
    "vocab_size": ("128", "vocab_size: Input should be a valid integer", 128),
    "first_k_dense_replace": (True, "first_k_dense_replace: Input should be a valid integer", 1),
    "rope_theta": (1e308, "rope_theta: Input should be less than or equal to 1000000000000", 1e12),
    "rms_norm_eps": (0.0, "rms_norm_eps: Input should be greater than or equal to 0.000000000001", 1e-12),
}


@pytest.mark.parametrize("field", sorted(CONFIG_ROWS))
def test_mistyped_and_absurd_config_values_are_one_line(field, tmp_path, capsys):
    from test_hostile_cli import IDS, make

    bad, needle, good = CONFIG_ROWS[field]
    d = make(tmp_path, "bad", config=lambda c: {**c, field: bad})
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS], capsys, tmp_path)
    assert f"{d / 'config.json'}: invalid config: {needle}" in line, line
    near = make(tmp_path, "near", config=lambda c: {**c, field: good})
    assert main(["decode", "--checkpoint", str(near), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS]) == 0


@pytest.mark.parametrize("text, needle", [
    ("Infinity", "rope_theta: Input should be a finite number"),
    ("NaN", "rope_theta: Input should be a finite number"),
])
def test_non_finite_json_numbers_in_config_are_refused(text, needle, tmp_path, capsys):
    from test_hostile_cli import IDS, make

    d = make(tmp_path, "inf")
    (d / "config.json").write_text((d / "config.json").read_text().replace('"rope_theta": ', f'"rope_theta": {text}, "x": '))
    line = run_cli(["decode", "--checkpoint", str(d), "--prompt-ids", "1,2,3", "--gen-length", "8", *IDS], capsys, tmp_path)
    assert needle in line, line


@pytest.mark.parametrize("value, shown", [(5, "int 5"), ({"foo": 1}, 'dict {"foo": 1}'), (["<|endoftext|>"], "list")])
def test_a_special_token_of_the_wrong_type_names_the_file_and_key(value, shown, tmp_path, capsys):
    folder = tmp_path / "ckpt"
    shutil.copytree(TESTBED, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": value}))
    line = run_cli(["decode", "--checkpoint", str(folder), "--prompt", "1+1=", "--gen-length", "4"], capsys, tmp_path)
    assert f"{folder / 'tokenizer_config.json'}: eos_token must be a token string" in line and shown in line, line


def test_an_added_token_object_is_still_a_special_token(tmp_path):
    """Near miss: the AddedToken form older transformers write loads, with the same EOS id."""
    from dlm_toolkit.models.tokenizer import find_tokenizer, special_ids

    folder = tmp_path / "tok"
    shutil.copytree(Path(__file__).resolve().parent / "fixtures" / "llada2.1-chat-tokenizer", folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    before = special_ids(find_tokenizer(folder))
    token = {"__type": "AddedToken", "content": cfg["eos_token"], "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": token}))
    assert special_ids(find_tokenizer(folder)) == before


@pytest.mark.parametrize("name, ok", [("", False), ("   ", False), ("e", True)])
def test_an_empty_mlflow_experiment_is_refused(name, ok, tmp_path, capsys):
    exp = h.write_yaml(tmp_path / "exp.yaml", h.experiment(mlflow_experiment=name))
    if ok:
        from dlm_toolkit.sweep.experiment import load_experiment

        assert load_experiment(exp).mlflow_experiment == "e"
        return
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/o.db", "--no-progress"], capsys, tmp_path)
    assert f"exp.yaml: mlflow_experiment: must name an MLflow experiment (got {name!r})" in line, line


def test_training_rope_theta_has_the_model_configs_bound():
    """A training config's rope_theta is refused where the model config would refuse it (after
    the output folder was claimed), with 1 itself the edge and a value just above it accepted."""
    from dlm_toolkit.training.config import load_train_config

    with pytest.raises(ConfigError, match="rope_theta"):
        load_train_config({"rope_theta": 1.0})
    assert load_train_config({"rope_theta": 1.5}).rope_theta == 1.5
