#!/usr/bin/env bash
# MegaDLMs' dlm_pretrain_1.7b.sh for dlmjax: the 1.7B masked-diffusion pre-training.
#
# On every node (envs/.env: NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE,
# PROCESSES_PER_NODE; scripts/slurm/dlm_pretrain_1p7b.sbatch sets them under SLURM):
#   TRAIN_PREFIXES="$DATASETS_DIR/corpus_text_document" TOKENIZER=/data/tokenizer.json \
#     bash scripts/dlm_pretrain_1p7b.sh [--config.key=value ...]
# CONFIG replaces the config file (CONFIG=configs/tiny.py runs the recipe's launch on a CPU).
# Check the mesh and memory first, in seconds: python -m dlmjax.summary --config=configs/pretrain_1p7b.py --devices=N
source "$(dirname "$0")/launch.sh"
args=(--config.output_dir="${OUTPUT_DIR:-$CKPT_DIR/dlm_pretrain_1p7b}")
[ -n "${TRAIN_PREFIXES:-}" ] && args+=(--config.data.train_prefixes="$TRAIN_PREFIXES")
[ -n "${TOKENIZER:-}" ] && args+=(--config.data.tokenizer="$TOKENIZER")
dlm_launch "${CONFIG:-configs/pretrain_1p7b.py}" "${args[@]}" "$@"
