#!/usr/bin/env bash
# SFT with MegaDLMs' launch conventions: on every node (envs/.env as for pre-training)
#   bash scripts/dlm_sft.sh CFG [--config.key=value ...]     e.g. CFG=configs/sft.py
# OUTPUT_DIR sets the run directory (default: $CKPT_DIR/dlm_sft).
source "$(dirname "$0")/launch.sh"
dlm_stage sft "$@"
