# Sourced by scripts/dlm_*.sh: MegaDLMs' launch conventions for dlmjax.
#
# Every node runs the same script with its own NODE_RANK. The script starts one training process
# per node (PROCESSES_PER_NODE=1) or one per GPU (PROCESSES_PER_NODE=$GPUS_PER_NODE; process i gets
# LOCAL_RANK=i). dlmjax.parallel.distributed turns NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT,
# GPUS_PER_NODE and LOCAL_RANK into jax.distributed.initialize; with one node and one process
# nothing is initialised. PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ENV_FILE=${DLMJAX_ENV_FILE:-envs/.env}  # tests point this elsewhere
if [ ! -f "$ENV_FILE" ]; then
  cp envs/.env.example "$ENV_FILE"
  echo "created $ENV_FILE from envs/.env.example; edit it for your cluster" >&2
fi
set -a
# shellcheck disable=SC1090
source "$ENV_FILE"
set +a
PYTHON=${PYTHON:-python}

# dlm_launch CONFIG [--config.key=value ...]: python -m dlmjax.train on this node.
dlm_launch() {
  local config=$1
  shift
  if [ "$PROCESSES_PER_NODE" = 1 ]; then
    exec "$PYTHON" -m dlmjax.train --config="$config" "$@"
  fi
  if [ "$PROCESSES_PER_NODE" != "$GPUS_PER_NODE" ]; then
    echo "error: PROCESSES_PER_NODE=$PROCESSES_PER_NODE must be 1 (one process per node) or" \
      "GPUS_PER_NODE=$GPUS_PER_NODE (one per GPU)" >&2
    exit 2
  fi
  local pids=() i status=0
  for ((i = 0; i < PROCESSES_PER_NODE; i++)); do
    LOCAL_RANK=$i "$PYTHON" -m dlmjax.train --config="$config" "$@" &
    pids+=($!)
  done
  # The first process to fail takes the node's others down (JAX's coordinator ends the rest).
  for ((i = 0; i < ${#pids[@]}; i++)); do
    wait -n || { status=$?; kill "${pids[@]}" 2>/dev/null || true; wait; break; }
  done
  exit "$status"
}

# dlm_stage NAME FROM CONFIG [--config.key=value ...]: a later stage (sft, rl) on this node. Its run
# directory is OUTPUT_DIR (default: $CKPT_DIR/dlm_NAME) and it starts from INIT_FROM (default:
# $CKPT_DIR/dlm_FROM, the run directory the stage before writes); overrides come last and win.
dlm_stage() {
  local name=$1 from=$2
  shift 2
  if [ $# -lt 1 ] || [ ! -f "${1%%:*}" ]; then
    echo "usage: bash scripts/dlm_$name.sh CFG [--config.key=value ...] (CFG a config file, e.g." \
      "configs/$name.py)" >&2
    exit 2
  fi
  local config=$1
  shift
  dlm_launch "$config" --config.output_dir="${OUTPUT_DIR:-$CKPT_DIR/dlm_$name}" \
    --config.init_from="${INIT_FROM:-$CKPT_DIR/dlm_$from}" "$@"
}
