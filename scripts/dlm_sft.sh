#!/usr/bin/env bash
# SFT with MegaDLMs' launch conventions: on every node (envs/.env as for pre-training)
#   bash scripts/dlm_sft.sh CFG [--config.key=value ...]     e.g. CFG=configs/sft.py
# OUTPUT_DIR sets the run directory (default: $CKPT_DIR/dlm_sft).
source "$(dirname "$0")/launch.sh"
if [ $# -lt 1 ] || [ ! -f "${1%%:*}" ]; then
  echo "usage: bash scripts/dlm_sft.sh CFG [--config.key=value ...] (CFG a config file, e.g." \
    "configs/sft.py)" >&2
  exit 2
fi
config=$1
shift
dlm_launch "$config" --config.output_dir="${OUTPUT_DIR:-$CKPT_DIR/dlm_sft}" "$@"
