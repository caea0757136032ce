#!/usr/bin/env bash
# Pre-train -> SFT -> RL on the tiny model, each stage scored on held-out problems:
#   bash scripts/three_stage_demo.sh [--seeds 0,1,2] [--output-dir runs/demo] [--task arithmetic]
# About 9 minutes per seed on a 2-core CPU; the table is also in OUTPUT_DIR/results.json
# (the recipe: configs/demo.py; the result: docs/benchmarks.md, Three-stage result).
# PYTHON picks the interpreter (default: python), as in scripts/launch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m dlmjax.demo "$@"
