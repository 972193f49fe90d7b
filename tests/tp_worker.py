"""One rank of the tensor/expert-parallel test (tests/test_distributed.py), or the single-process
baseline when imported: decodes the conformance fixture and a random checkpoint, writes JSON.

Run: ``torchrun --standalone --nproc-per-node 2 tests/tp_worker.py RANDOM_CKPT OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.evaluation.conformance import case_policy, check_logits, compare, observed
from dlm_toolkit.models.distributed import init_from_env
from dlm_toolkit.models import TensorParallel, load_model

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "conformance/llada2_tiny"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
DLM = str(Path(sys.executable).parent / "dlm")
PROMPTS = [[5, 9, 2], [7, 1, 4, 4, 8, 3, 11], [12]]
POLICIES = {
    "q": DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4}),
    "s": DecodingPolicy("llada2.1-s", **{"blocks.params.block_length": 4}),
    "sampled": DecodingPolicy("llada2.1-q", **{"blocks.params.block_length": 4, "sampling.temperature": 0.8}),
}


def run_bounded(cmd: list[str], timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a launcher and its ranks in their own session from the repository root, one thread
    each; on timeout kill the whole process group."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run(random_checkpoint: str | Path, tp: TensorParallel | None = None) -> dict:
    """Tokens and NFE of every fixture case (KV cache on and off) and of a batch of prompts on the
    random checkpoint under each policy, plus the fixture's conformance failures."""
    spec = json.loads((FIXTURE / "cases.json").read_text())
    model = load_model(FIXTURE, mask_token_id=spec["mask_id"], eos_token_id=spec["eos_id"], tp=tp)
    out: dict = {"failures": [f for c in check_logits(model, FIXTURE, spec["logits_fixture"]) for f in c.failures]}
    for case in spec["cases"]:
        for kv in (True, False):
            result = decode(model, [case["prompt_ids"]], case_policy(case), case["gen_length"], kv_cache=kv, record=True)
            out[f"{case['name']} kv={kv}"] = [result.rows[0].tokens, result.rows[0].nfe]
            out["failures"] += compare(case, observed(case, result, spec["mask_id"]))[0]
    model = load_model(random_checkpoint, tp=tp)
    for name, policy in POLICIES.items():
        result = decode(model, PROMPTS, policy, 12, seed=3)
        out[f"random {name}"] = [[row.tokens, row.nfe] for row in result.rows]
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    tp, _ = init_from_env("cpu")
    result = run(sys.argv[1], tp)
    result["world"] = tp.world
    Path(sys.argv[2], f"rank{tp.rank}.json").write_text(json.dumps(result))
