#!/usr/bin/env bash
# Multi-GPU scaling of the 1.7B step on one host, and the 8B-shaped layouts: each layout's
# `python -m dlmjax.bench` JSON line, prefixed with its name, the one-GPU baseline first.
# Usage: bash benchmarks/scaling.sh NUM_GPUS [1p7b|8b|all]   (docs/benchmarks.md, Several GPUs)
set -u
n=${1:?usage: bash benchmarks/scaling.sh NUM_GPUS [1p7b|8b|all]}; which=${2:-all}
B="python3 -m dlmjax.bench --config=configs/pretrain_1p7b.py --matmul=false"
Q8="--config.model.num_layers=36 --config.model.d_model=4096
 --config.model.num_heads=32 --config.model.num_kv_heads=8 --config.model.head_dim=128
 --config.model.ffn_dim=12288 --config.model.vocab_size=151936 --config.model.mask_token_id=151669
 --config.model.eos_token_id=151645 --config.model.pad_token_id=151643
 --config.model.rope_theta=1000000 --config.model.remat=save_dots_attention"
run() {
  local name=$1; shift
  "$@" 2>&1 | grep -E '^\{|rror' | tail -n 2 | sed "s/^/$name /"
}
rows() { echo "--config.train.micro_batch_size=$1 --config.train.global_batch_size=$1"; }
if [ "$which" != 8b ]; then
  run one_gpu_mb8 env CUDA_VISIBLE_DEVICES=0 $B --steps=10 $(rows 8)
  run one_gpu_mb8_unrolled env CUDA_VISIBLE_DEVICES=0 $B --steps=10 $(rows 8) \
    --config.model.scan_layers=false
  for unroll in true false; do
    run "data${n}_scan_${unroll}" $B --steps=10 $(rows $((8 * n))) --config.mesh.data="$n" \
      --config.mesh.fsdp=1 --config.model.scan_layers=$unroll
    run "fsdp${n}_scan_${unroll}" $B --steps=10 $(rows $((8 * n))) --config.mesh.fsdp="$n" \
      --config.model.scan_layers=$unroll
  done
  run "tensor2_fsdp$((n / 2))" $B --steps=10 $(rows $((4 * n))) --config.mesh.tensor=2 \
    --config.mesh.fsdp=$((n / 2))
fi
# The 8B rows (Q8) keep the attention kernel's outputs but recompute the elementwise work
# (save_dots_attention): save_activations, the 1.7B default, would need ~117 GiB per GPU at 8 rows.
if [ "$which" != 1p7b ] && [ "$n" -ge 4 ]; then
  run "8b_fsdp${n}" $B --steps=6 $Q8 $(rows $((4 * n))) --config.mesh.fsdp="$n"
  run "8b_fsdp$((n / 2))_tensor2" $B --steps=6 $Q8 $(rows $((4 * n))) \
    --config.mesh.fsdp=$((n / 2)) --config.mesh.tensor=2
  run "8b_tensor4_fsdp$((n / 4))" $B --steps=6 $Q8 $(rows $((4 * n))) \
    --config.mesh.fsdp=$((n / 4)) --config.mesh.tensor=4
  run "8b_fsdp${n}_mb8" $B --steps=6 $Q8 $(rows $((8 * n))) --config.mesh.fsdp="$n"
  # Pipeline (GPipe, 8 pipeline micro-batches per micro-batch): 36 layers split 4 or 2 ways.
  run "8b_pipeline4_fsdp$((n / 4))" $B --steps=6 $Q8 $(rows $((4 * n))) --config.mesh.pipeline=4 \
    --config.mesh.fsdp=$((n / 4)) --config.mesh.pipeline_microbatches=8
  run "8b_pipeline2_fsdp$((n / 2))" $B --steps=6 $Q8 $(rows $((4 * n))) --config.mesh.pipeline=2 \
    --config.mesh.fsdp=$((n / 2)) --config.mesh.pipeline_microbatches=8
fi
