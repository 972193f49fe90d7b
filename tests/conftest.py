import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # lm-eval tasks over local JSONL files

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "conformance" / "llada2_tiny"
sys.path.insert(0, str(REPO))  # conformance/reference.py: the reference transcription tests compare against


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    assert FIXTURE.is_dir(), f"conformance fixtures expected at {FIXTURE}"
    return FIXTURE

# Tiny models: one intra-op thread avoids OpenMP spin-waiting on a loaded 2-core machine.
import torch  # noqa: E402

torch.set_num_threads(1)
