#!/usr/bin/env bash
# The system packages the test suite needs, installed when missing (and said so):
#   bubblewrap    bwrap: the OS sandbox generated code runs in (tests of the code benchmarks)
#   postgresql    initdb/postgres: tests/test_scale_out.py runs sweeps against a real server
#   python3-venv  `python3 -m venv`: Debian's python3 comes without it
#   chromium, chromium-driver  the headless browser tests/test_viewer_browser.py opens the viewer pages in
#                 (Selenium drives the system chromedriver: no browser download)
# Debian/Ubuntu (apt-get): as root directly, otherwise through sudo. Nothing missing: no output.
set -euo pipefail
need=()
bwrap --version >/dev/null 2>&1 || need+=(bubblewrap)
initdb=$(compgen -G "/usr/lib/postgresql/*/bin/initdb" | tail -1 || true)
"${initdb:-initdb}" --version >/dev/null 2>&1 || need+=(postgresql)
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || need+=(python3-venv)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
[ ${#need[@]} -eq 0 ] && exit 0
echo "scripts/install-test-deps.sh: installing ${need[*]} (apt-get install ${need[*]})" >&2
run=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "error: not root and no sudo; as root run: apt-get install -y ${need[*]}" >&2
    exit 1
  fi
  run=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${run[@]}" apt-get update -qq
"${run[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
