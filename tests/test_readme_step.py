"""README's "One decode step, in reading order" names every toolkit file a default decode runs besides
the model's own (issue 43): a profiler hook records the files of every Python function called while
``decode`` runs with the default policy (built beforehand), and the set must equal the files the numbered list names."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dlm_toolkit import DecodingPolicy, decode
from dlm_toolkit.testing import tiny_llada2

ROOT = Path(__file__).resolve().parents[1]
OWN = ("dlm_toolkit/", "strategies/")
MODEL = "dlm_toolkit/models/"  # the model's forward: not the step's (the models package knows no decoding)


def listed() -> set[str]:
    """The paths the numbered items of the README section name."""
    text = (ROOT / "README.md").read_text()
    start = text.index("**One decode step, in reading order**")
    section = text[start:text.index("\n\n", text.index("\n1. ", start))]
    return set(re.findall(r"`((?:dlm_toolkit|strategies)/[\w/]+\.py)`", section[section.index("\n1. "):]))


def traced(run) -> set[str]:
    """The toolkit files (outside the model) whose functions ``run()`` calls."""
    seen: set[str] = set()
    root = str(ROOT) + "/"

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root):
            seen.add(name[len(root):])

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return {f for f in seen if f.startswith(OWN) and not f.startswith(MODEL)}


def test_the_readme_step_lists_every_file_a_default_decode_runs():
    model, policy = tiny_llada2(seed=3), DecodingPolicy("llada2.1-q")  # the policy built before: the step only
    decode(model, [[5, 6, 7]], policy, 8)  # imports and first-use caches out of the way
    files = traced(lambda: decode(model, [[5, 6, 7], [8, 9]], policy, 8))
    assert "dlm_toolkit/decoding/loop.py" in files and "strategies/blocks_semi_ar.py" in files  # the tracer sees them
    assert listed() == files
