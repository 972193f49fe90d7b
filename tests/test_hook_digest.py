"""Tokens, NFE and every counter are those of the code before the step hooks (issue 36 Part 2):
``benchmarks/hook_digest.json`` was written by ``benchmarks/hook_digest.py --write`` on the commit
before the refactor; this decodes its quick subset (the policies with a hook, and Q, on a random
model at batch 3, KV cache on and off) and compares. The whole digest (conformance fixtures,
testbed, batch 1/3/8, MBE, temperature 1, check_every, compiled) runs with ``--check``."""

from __future__ import annotations

import json
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import hook_digest  # noqa: E402


def test_the_quick_subset_matches_the_digest_of_the_code_before_the_hooks():
    want = json.loads((REPO / "benchmarks" / "hook_digest.json").read_text())
    got = hook_digest.digest(quick=True)
    assert len(got) == 10
    for name, value in got.items():
        assert "error" not in value, (name, value)
        assert value == want[name], name
