"""The third hostile table (issue 35, inputs): privileges a file asks for, chat templates that loop
or explode, benchmark data files that are deep, special or mistyped, plug-in budgets past any
bound, and config values of the wrong type or range. Every row: exit 2 (or a ConfigError), one
line naming the field or the file, nothing written, and a near-miss next to it still accepted."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

import sweep_helpers as h
from dlm_toolkit import chat
from dlm_toolkit.cli import main
from dlm_toolkit.config import ConfigError
from test_hostile_cli import TESTBED, run_cli
from test_hostile_inputs import settings_with, snapshot, store_template  # noqa: F401  (a fixture)

BENCH = Path(__file__).resolve().parent / "fixtures" / "benchmarks"


@pytest.fixture(autouse=True)
def no_hang():
    """A row that hangs fails the test instead of hanging the suite."""
    def hung(signum, frame):
        raise TimeoutError("the command hung")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(90)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


# ----------------------------------------------------------------------------------------------- privileges
def test_an_experiment_file_cannot_grant_unsafe_exec(tmp_path, capsys):
    exp = h.write_yaml(tmp_path / "exp.yaml", h.experiment(task="mbpp", task_args={
        "data": str(BENCH / "mbpp"), "unsafe_exec": False}))
    line = run_cli(["sweep", str(exp), "--storage", f"sqlite:///{tmp_path}/o.db", "--no-progress"], capsys, tmp_path)
    assert "exp.yaml: task_args.unsafe_exec:" in line and "`dlm sweep --unsafe-exec`" in line, line


def test_the_flag_grants_it_and_a_resume_may_drop_it():
    """Near miss: the same experiment without the key loads; ``--unsafe-exec`` puts it in the task's
    arguments (a code task only), and it is no result setting (a resume without it is the same study)."""
    from dlm_toolkit.sweep.experiment import load_experiment

    data = h.experiment(task="mbpp", task_args={"data": str(BENCH / "mbpp")})
    plain, granted = load_experiment(data), load_experiment(data, unsafe_exec=True)
    assert "unsafe_exec" not in plain.task_args and granted.task_args["unsafe_exec"] is True
    assert plain.result_settings() == granted.result_settings()
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
    """Near misses: 1000 bytes (the cap) and 10^6 loop steps render; the renderer survives a refusal
    (the next prompt starts a fresh child) and its ids are transformers' own."""
    from transformers import AutoTokenizer

    from dlm_toolkit.tokenizer import find_tokenizer

    folder = templated("{{ 'x' * 1001 }}")
    with pytest.raises(ConfigError, match="renders 1001 bytes"):
        chat.chat_text(find_tokenizer(folder), chat.messages_for("q"))
    folder = templated("{{ 'y' * (1000 - messages[0].content | length) }}{{ messages[0].content }}")
    assert chat.chat_text(find_tokenizer(folder), chat.messages_for("1+1=")) == "y" * 996 + "1+1="
    folder = templated("{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
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
