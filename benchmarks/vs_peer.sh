#!/usr/bin/env bash
# Runs the PyTorch peer and dlmjax's benchmark back to back on this GPU machine (same run, same
# card) and prints one JSON line with both figures and the ratio.
# Usage: bash benchmarks/vs_peer.sh PATH/TO/torch_peer.py MICRO_BATCH [--config.x=y ...]
set -euo pipefail
peer_script=$1; micro_batch=$2; shift 2
peer=$(python3 "$peer_script" --micro-batch "$micro_batch" --compile | grep '^{' | tail -n 1)
ours=$(python3 -m dlmjax.bench --config=configs/pretrain_1p7b.py --matmul=false \
  --config.train.micro_batch_size="$micro_batch" --config.train.global_batch_size="$micro_batch" \
  "$@" | grep '^{' | tail -n 1)
python3 - "$peer" "$ours" <<'PY'
import json, sys
peer, ours = (json.loads(a) for a in sys.argv[1:3])
print(json.dumps({
    'micro_batch': ours['micro_batch'], 'peer_tokens_per_s': peer['tokens_per_s'],
    'ours_tokens_per_s': ours['tokens_per_s'],
    'ratio': round(ours['tokens_per_s'] / peer['tokens_per_s'], 3),
    'peer_peak_gib': peer['peak_mem_gib'], 'ours_peak_gib': ours.get('peak_mem_gib'),
    'ours': ours, 'peer': peer}))
PY
