#!/usr/bin/env bash
# RL with MegaDLMs' launch conventions: on every node (envs/.env as for pre-training)
#   bash scripts/dlm_rl.sh CFG [--config.key=value ...]     e.g. CFG=configs/rl.py
# Starts from INIT_FROM (default: $CKPT_DIR/dlm_sft, what dlm_sft.sh writes); OUTPUT_DIR sets the
# run directory (default: $CKPT_DIR/dlm_rl).
source "$(dirname "$0")/launch.sh"
dlm_stage rl sft "$@"
