"""The notebooks run headless top to bottom on this venv's Python and are committed without outputs.

Each notebook runs in a fresh kernel whose kernelspec is written here (so it is this interpreter,
whatever other ``python3`` kernelspecs the machine has), with the notebooks folder as working
directory (they find the repository root from there), one torch/OpenMP thread (a loaded 2-core
machine) and ``TMPDIR`` pointed at the test's temporary folder (the notebooks keep their Optuna /
MLflow stores under ``tempfile``). The test fails on any cell error and if a notebook wrote into
the repository.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = ("01_decode_anatomy.ipynb", "02_write_a_strategy.ipynb", "03_sweep_analysis.ipynb")
CHECKPOINT = REPO / "checkpoints" / "testbed-editable"
KERNEL = "dlm-toolkit-test"
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


def kernel_manager(tmp: Path) -> KernelManager:
    """A kernel of this very interpreter, single-threaded, with TMPDIR inside ``tmp``."""
    spec_dir = tmp / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    work = tmp / "work"
    work.mkdir()
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dlm-toolkit tests",
        "language": "python",
        "env": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TMPDIR": str(work)},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")])
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path):
    assert CHECKPOINT.is_dir(), f"the notebooks use the shipped checkpoint {CHECKPOINT}, which is missing"
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    check = f"import sys; assert sys.executable == {sys.executable!r}, sys.executable"
    nb.cells.insert(0, nbformat.v4.new_code_cell(check))
    before = set(NOTEBOOK_DIR.iterdir())
    root_before = {n for n in ROOT_LITTER if (REPO / n).exists()}
    km = kernel_manager(tmp_path)
    client = NotebookClient(nb, km=km, timeout=300, allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError naming the cell on any error
    finally:
        if km.has_kernel:  # a kernel manager passed in is not shut down by nbclient
            km.shutdown_kernel(now=True)
    print(f"{name}: {time.perf_counter() - t0:.1f} s")
    assert set(NOTEBOOK_DIR.iterdir()) == before, f"{name} wrote into notebooks/"
    litter = {n for n in ROOT_LITTER if (REPO / n).exists()} - root_before
    assert not litter, f"{name} wrote {sorted(litter)} into the repository root"
