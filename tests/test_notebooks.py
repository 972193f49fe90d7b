"""The notebooks run headless top to bottom with README's ``jupyter nbconvert`` line, from a fresh shell
with README's activation line, and are committed without outputs.

The kernel is the venv's (``python3``, found in the venv's ``share/jupyter`` once it is active; the
fresh shell's ``HOME`` is the test's folder, so no other ``python3`` kernelspec of the user can win),
with the notebooks folder as working directory (they find the repository root from there), one
torch/OpenMP thread (a loaded 2-core machine) and ``TMPDIR`` pointed at the test's temporary folder
(the notebooks keep their Optuna / MLflow stores under ``tempfile``). The test fails on any cell error
and if a notebook wrote into the repository.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import nbformat
import pytest

import readme_shell

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = ("01_decode_anatomy.ipynb", "02_write_a_strategy.ipynb", "03_sweep_analysis.ipynb", "04_catalogue.ipynb",
             "05_oracle.ipynb")
CHECKPOINT = REPO / "checkpoints" / "testbed-editable"
# what a notebook could leave in the repository root if it used default paths
ROOT_LITTER = ("mlflow.db", "optuna.db", "mlruns", "mlartifacts", "pareto.png")


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name} cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{name} cell {i} has an execution count: clear outputs"


def headless_line(name: str, out: Path) -> str:
    """README's headless line for notebook ``name``, writing into ``out`` (README: runs/notebooks)."""
    [line] = [b.splitlines()[-1] for b in readme_shell.bash_blocks(readme_shell.section("Notebooks"))
              if "nbconvert" in b]
    command = line.split("  #", 1)[0].strip()
    assert command.endswith(" --output-dir runs/notebooks notebooks/01_decode_anatomy.ipynb"), command
    return command.replace("runs/notebooks", str(out)).replace("01_decode_anatomy.ipynb", name)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path):
    assert CHECKPOINT.is_dir(), f"the notebooks use the shipped checkpoint {CHECKPOINT}, which is missing"
    before = set(NOTEBOOK_DIR.iterdir())
    root_before = {n for n in ROOT_LITTER if (REPO / n).exists()}
    (tmp_path / "work").mkdir()
    env = readme_shell.fresh_env(HOME=str(tmp_path), TMPDIR=str(tmp_path / "work"))
    t0 = time.perf_counter()
    done = readme_shell.run(headless_line(name, tmp_path / "out"), env=env, timeout=600)
    print(f"{name}: {time.perf_counter() - t0:.1f} s")
    assert done.returncode == 0, done.stderr[-4000:]  # nbconvert names the failing cell and its error
    executed = json.loads((tmp_path / "out" / name).read_text())
    assert all(c.get("execution_count") for c in executed["cells"] if c["cell_type"] == "code")
    printed = json.dumps([c.get("outputs", []) for c in executed["cells"]])
    assert "IProgress not found" not in printed, f"{name}: tqdm found no ipywidgets (the [notebooks] extra pins it)"
    assert set(NOTEBOOK_DIR.iterdir()) == before, f"{name} wrote into notebooks/"
    litter = {n for n in ROOT_LITTER if (REPO / n).exists()} - root_before
    assert not litter, f"{name} wrote {sorted(litter)} into the repository root"
