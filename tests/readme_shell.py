"""README's code blocks as a new user runs them: a fresh ``bash`` (no profile, a bare ``PATH``, no
variable of the test process but a few harmless ones), README's ``source .venv/bin/activate`` line,
then the block's lines as written, from the repository root.

``.venv`` is this interpreter's environment: the same folder when the tests run the way README says;
another one is put in its place (the only substitution made).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
BARE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def readme() -> str:
    return (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The text of the README section ``## title`` (up to the next ``## ``)."""
    text = readme()
    return text[text.index(f"## {title}\n"):].split("\n## ", 1)[0]


def fences(text: str | None = None) -> list[tuple[str, str]]:
    """``(info string, body)`` of every fenced block of ``text`` (default: the whole README), in order."""
    out, info, body = [], None, []
    for line in (readme() if text is None else text).splitlines():
        if info is None and line.startswith("```"):
            info, body = line[3:].strip(), []
        elif info is not None and line.strip() == "```":
            out.append((info, "\n".join(body)))
            info = None
        elif info is not None:
            body.append(line)
    return out


def bash_blocks(text: str | None = None) -> list[str]:
    """The ```` ```bash ```` blocks of ``text`` (default: the whole README), in order."""
    return [body for info, body in fences(text) if info == "bash"]


def activation_line() -> str:
    """README's activation command (the one-line block right after the two set-up commands)."""
    line = bash_blocks()[2]
    assert line == "source .venv/bin/activate", line
    return line if VENV == REPO / ".venv" else f"source {VENV}/bin/activate"


def fresh_env(**extra: str) -> dict[str, str]:
    """What a new login shell has, more or less: no virtual environment, no PYTHONPATH."""
    env = {"PATH": BARE_PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
           "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
           # a test machine is offline and loaded: no hub look-ups, one thread per process
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.update(extra)
    return env


def script(lines: str, *, activate: bool = True) -> str:
    """A bash script: stop at the first failing line, activate, then ``lines``."""
    return "set -e\n" + (activation_line() + "\n" if activate else "") + lines + "\n"


def start(lines: str, *, cwd: Path = REPO, env: dict[str, str] | None = None, user: str | None = None,
          activate: bool = True) -> subprocess.Popen:
    """Run ``lines`` in a fresh bash in its own session (so :func:`stop` ends it and everything it
    started); ``user``: run as that user (``su USER -s /bin/bash``, what README tells root to do)."""
    argv = ["bash", "--noprofile", "--norc", "-c", script(lines, activate=activate)]
    if user is not None:
        argv = ["su", user, "-s", "/bin/bash", "-c", " ".join(_quote(a) for a in argv)]
    return subprocess.Popen(argv, cwd=cwd, env=env or fresh_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def run(lines: str, *, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """:func:`start`, wait (killing the whole session on timeout), return what it printed."""
    proc = start(lines, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{lines}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def stop(proc: subprocess.Popen) -> None:
    """Kill ``proc``'s whole session (background jobs of the script included)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _quote(arg: str) -> str:
    return "'" + arg.replace("'", "'\"'\"'") + "'"
