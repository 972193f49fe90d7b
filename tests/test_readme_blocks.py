"""README's code blocks work as written from a fresh shell: the activation line comes right after the
two set-up commands, every program the README names resolves after it (no activated venv assumed),
and the CPU blocks whose output README shows print that output. (The "Full scale" CPU block runs in
tests/test_moe_full_scale.py, the "Scale out" block in tests/test_scale_out.py, the same way.)"""

from __future__ import annotations

import re
import shlex

import pytest

import readme_shell

# What README lines may call without the venv: the shell's own words and the system's tools.
SHELL_WORDS = {"export", "source", "echo", "set", "wait", "cd", "kill", "pkill", "rm", "ls", "tail"}
SYSTEM_TOOLS = {"python3", "bash", "apt-get", "initdb", "pg_ctl", "psql", "su", "curl"}  # PostgreSQL: Scale out's PATH line


def command_words(block: str) -> set[str]:
    """The program each command of a block starts with (comments, continuation lines, variable
    assignments before the program, ``&&``/``;``/``|``/``&`` chains and ``<(...)`` handled)."""
    words = set()
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.commenters = "#"
        start = True
        for token in lexer:
            if token in {"&&", "||", ";", "|", "&", "(", "<(", "$("}:
                start = True
            elif token == ")":
                start = False
            elif start and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", token) and token not in {"<", ">", ">>"}:
                words.add(token)
                start = False
    return words


def all_blocks() -> list[str]:
    """Every fenced block a reader is meant to run: ```bash ones and the bare ``` ones (GPU lines);
    not the "Command line" synopsis (placeholders and alternatives, not commands)."""
    synopsis = readme_shell.section("Command line")
    return [body for info, body in readme_shell.fences() if info in ("bash", "") and body not in synopsis]


def test_activation_comes_right_after_the_two_setup_commands():
    text = readme_shell.readme()
    blocks = readme_shell.bash_blocks()
    assert blocks[2] == "source .venv/bin/activate"
    between = text[text.index(blocks[1]) + len(blocks[1]):text.index(blocks[2])]
    assert "```" in between and "## " not in between  # the next block, in the same section


def test_every_program_readme_names_resolves_in_a_fresh_shell_after_activation():
    names = set().union(*(command_words(b) for b in all_blocks()[3:] if not b.startswith("{")))
    wanted = sorted(names - SHELL_WORDS - SYSTEM_TOOLS - {".venv/bin/activate"})
    assert {"dlm", "python", "torchrun", "pip", "mlflow", "optuna-dashboard", "jupyter"} <= set(wanted), wanted
    done = readme_shell.run("\n".join(f"command -v {shlex.quote(w)}" for w in wanted), timeout=60)
    assert done.returncode == 0, (wanted, done.stdout, done.stderr)
    found = dict(zip(wanted, done.stdout.split()))
    for word, path in found.items():
        assert path.startswith(str(readme_shell.VENV)), (word, path)  # the venv's, not a system one
    without = readme_shell.run("command -v dlm", activate=False, timeout=60)
    assert without.returncode != 0  # the fresh shell really has no venv: README's line is what makes it work


def expected_lines(block: str) -> list[str]:
    """README's ``# ...`` lines under a command: what it prints (leading spaces aside)."""
    return [line[2:] for line in block.splitlines() if line.startswith("# ")]


@pytest.mark.parametrize("title, start", [
    ("The model", "dlm conformance"),
    ("Comparing policies", "dlm compare --checkpoint checkpoints/testbed-editable"),
    ("Comparing policies", "dlm compare --checkpoint checkpoints/testbed-v2-editable"),
    ("Oracle models", "dlm eval --checkpoint oracle:list_shuffle"),
])
def test_blocks_print_what_readme_shows(title, start):
    [block] = [b for b in readme_shell.bash_blocks(readme_shell.section(title)) if b.startswith(start)]
    done = readme_shell.run(block, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line.strip() for line in done.stdout.splitlines()]
    if start == "dlm conformance":  # comments after the commands: "... 36 passed, 0 failed (...)"
        for count in re.findall(r"# \.\.\. (\d+ passed, 0 failed)", block):
            assert count in printed, (count, printed)
        return
    for line in expected_lines(block):
        assert line.strip() in printed, (line, printed)
