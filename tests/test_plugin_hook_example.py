"""The example plug-in's step hook (issue 45 item 7): its contract suite passes as the package ships it,
and README's "hook with parameters" block is that file's code, so README shows what runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plugin-package"


def test_readme_hook_blocks_are_the_example_plugins_code() -> None:
    blocks = re.findall(r"```python\n(.+?)```", (REPO / "README.md").read_text(), re.S)
    [hook] = [b for b in blocks if "class FreezeFirst(StepHook)" in b and "__init__(self, frozen" in b]
    assert hook in (EXAMPLE / "src" / "dlm_example_plugin" / "hooks.py").read_text()
    [suite] = [b for b in blocks if "(StepHookContract)" in b]
    assert suite in (EXAMPLE / "tests" / "test_hook.py").read_text()
    assert '"frozen": 2' in suite  # the parameter set from a policy file


def test_the_example_hook_passes_its_contract_suite(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(EXAMPLE / "src"), str(REPO)])}  # as `pip install -e` would
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           str(EXAMPLE / "tests" / "test_hook.py")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"\b11 passed\b", done.stdout) and "failed" not in done.stdout, done.stdout[-2000:]
