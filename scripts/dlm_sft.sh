#!/usr/bin/env bash
# SFT with MegaDLMs' launch conventions: on every node (envs/.env as for pre-training)
#   bash scripts/dlm_sft.sh CFG [--config.key=value ...]     e.g. CFG=configs/sft.py
# Starts from INIT_FROM (default: $CKPT_DIR/dlm_pretrain_1p7b, what dlm_pretrain_1p7b.sh writes);
# OUTPUT_DIR sets the run directory (default: $CKPT_DIR/dlm_sft, what dlm_rl.sh reads).
source "$(dirname "$0")/launch.sh"
dlm_stage sft pretrain_1p7b "$@"
