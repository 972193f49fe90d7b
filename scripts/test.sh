#!/usr/bin/env bash
# README's test command, and exactly what .ci/run runs: on a bare Debian/Ubuntu machine with
# Python 3 it installs the system packages the tests need (scripts/install-test-deps.sh says which),
# the package with its test extras into .venv, then runs pytest (arguments are passed on) with one worker
# per core up to 4 (DLM_TEST_WORKERS overrides; 0 runs in this process). Files, not single tests, are the
# unit of distribution: a file's servers and module fixtures then start once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-deps.sh
python3 -m venv .venv
.venv/bin/pip install -q -e ".[test]"
.venv/bin/pip install -q --no-deps bigcodebench==0.2.5  # its grader (numpy only) checks ours: tests/test_bigcodebench.py
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false PYTHONUNBUFFERED=1
workers=${DLM_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
