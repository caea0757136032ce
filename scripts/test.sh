#!/usr/bin/env bash
# Sets up a virtual environment with the test dependencies (CPU JAX, PyTorch for the conversion
# tests, ruff), checks lint and format (ruff, settings in pyproject.toml; `ruff format .` fixes
# the format) and runs the whole suite, as CI does. Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DLMJAX_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CPU build of PyTorch first, so the `torch` extra does not pull a multi-GB CUDA build.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[dev,torch,tfds,eval,plot,serve]"
# The code sandbox's OS boundary (docs/evaluation.md, Code sandbox): bubblewrap. As root with apt
# (CI), install it; where it cannot be (no network), the hostile-program suite skips and says why.
if ! command -v bwrap >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  timeout 300 apt-get install -y -qq bubblewrap >/dev/null 2>&1 ||
    { timeout 300 apt-get update -qq >/dev/null 2>&1 &&
      timeout 300 apt-get install -y -qq bubblewrap >/dev/null 2>&1; } ||
    echo 'bubblewrap could not be installed: the code sandbox has no OS boundary here'
fi
"$PY" -m ruff check .
"$PY" -m ruff format --check .
export DLMJAX_CACHE_DIR=${DLMJAX_CACHE_DIR:-$PWD/.cache/dlmjax}
# Whole test files per worker (loadscope): a module-scoped fixture (a tiny training run, a model
# directory) is built once; with per-test distribution both workers often build it.
# --durations=25: every log names the slowest tests, where the 15-minute budget goes.
exec "$PY" -m pytest -n 2 --dist loadscope -q --durations=25 "$@"
