"""MegaDLMs' 1.7B masked-diffusion pre-training (examples/dlm_training/dlm_pretrain_1.7b.sh).

    python -m dlmjax.train --config=configs/pretrain_1p7b.py \
        --config.data.train_prefixes="/data/corpus_text_document" \
        --config.data.tokenizer=/data/tokenizer.json --config.output_dir=/ckpt/dlm1p7b

Qwen3-1.7B shape (28 x 2048, 16 heads x 128, SwiGLU 6144, QK-norm, untied), vocab 50289 padded to
50304, seq 2048, AdamW(0.9, 0.95, wd 0.1), lr 2e-4 -> 2e-5 WSD with 2000 warmup steps and an
exponential anneal over the last 1000, clip 1.0, 256 sequences (524,288 tokens) per step.
`train.micro_batch_size` counts rows per accumulation step over the whole mesh: MegaDLMs' 4 per
GPU on 8 GPUs is 32. `:smoke` shrinks it to a CPU-sized model for a dry run of the same recipe.
"""

from dlmjax import config as config_lib


def get_config(arg=None):
  c = config_lib.defaults()
  config_lib.apply_preset(c.model, '1p7b')
  c.output_dir = 'runs/pretrain_1p7b'
  c.data.source = 'megatron'
  c.model.dtype = 'bfloat16'
  c.model.attention_backend = 'cudnn'
  # The Pallas norm kernels on GPU (kernels/rms_norm.py): 48.1k tokens/s against 47.5k for
  # XLA's fusions, run back to back (docs/benchmarks.md, RMSNorm kernels); the formula elsewhere.
  c.model.norm_backend = 'auto'
  # Saves every activation the backward reads (bf16) and the attention kernel's outputs: the
  # fastest measured at micro-batch 8 and 16, at 57 GiB (mb 8) against the peer's 64
  # (docs/benchmarks.md, 1.7B pre-training step); save_dots_attention needs 46 GiB for 1.2% less
  # speed.
  c.model.remat = 'save_activations'
  # Unrolled layers: the same speed on one GPU (41.9k vs 42.0k tokens/s) but FSDP overlaps its
  # gathers better, 95.3% vs 93.1% on 2 GPUs and 94.4% vs 90.6% on 4 (docs/benchmarks.md,
  # Several GPUs of one host), for a compile of ~20 s instead of ~10.
  c.model.scan_layers = False
  c.train.steps = 19_073_486  # 1e13 tokens / 524,288, as upstream; override for real runs.
  c.train.global_batch_size = 256
  c.train.micro_batch_size = 8
  c.train.lr = 2e-4
  c.train.min_lr = 2e-5
  c.train.schedule = 'wsd'  # exponential anneal, as MegaDLMs' --lr-wsd-decay-style
  c.train.warmup_steps = 2000
  c.train.wsd_decay_steps = 1000
  c.train.weight_decay = 0.1
  c.train.clip_grad_norm = 1.0
  c.checkpoint.every = 19_073
  c.log.every = 50
  if arg == 'smoke':
    config_lib.apply_preset(c.model, 'tiny')
    c.model.dtype = 'float32'
    c.model.attention_backend = 'xla'
    c.model.remat = 'none'
    c.data.source = 'builtin'
    c.model.vocab_size, c.model.mask_token_id, c.model.eos_token_id = 4096, 3, 2
    c.model.pad_token_id = 0
    c.train.steps, c.train.warmup_steps, c.train.wsd_decay_steps = 20, 2, 5
    c.train.global_batch_size, c.train.micro_batch_size = 16, 8
    c.checkpoint.every, c.log.every = 0, 5
    c.output_dir = 'runs/pretrain_1p7b_smoke'
  return c
