"""Adapt an autoregressive Qwen3 checkpoint into a block-diffusion LM by continued training (SDAR).

    python -m dlmjax.train --config=configs/adapt_block_qwen3.py \
        --config.init_from=/models/Qwen3-1.7B \
        --config.data.train_prefixes="/data/corpus_text_document" \
        --config.data.tokenizer=/models/Qwen3-1.7B/tokenizer.json --config.output_dir=/ckpt/bd

The AR weights are kept as they are; only the attention changes (block_causal: bidirectional
inside a block, causal across blocks) and the objective becomes BD3LM's block diffusion over
[x_t || x_0] (diffusion.objective=block, docs/block_diffusion.md). The recipe's numbers come
from SDAR (JetAstra/SDAR README and training yamls): block size 4 in continued pre-training
(their 50B tokens; blocks 8-64 only in a later SFT), mask id 151669 (the first free row of
Qwen3's 151,936), learning rate 1e-5 with a 3% linear warmup and then constant. Fast-dLLM v2
adapts Qwen2.5-7B-Instruct with ~1B tokens and block 32, but predicts each masked token from the
position before it (token shift), which this objective does not do. A Qwen2 or Llama source
works the same way with that model's preset (config_lib.apply_preset) in place of qwen3_1p7b.

`:smoke` is the same recipe on the tiny model and the built-in corpus, adapting the AR run that
    python -m dlmjax.train --config=configs/tiny.py --config.diffusion.objective=ar \
        --config.model.attention_mask=causal --config.output_dir=runs/tiny_ar
writes (benchmarks/block_adapt.py runs the whole comparison on CPU).
"""

from dlmjax import config as config_lib

SDAR_MASK_TOKEN_ID = 151669


def get_config(arg=None):
  c = config_lib.defaults()
  config_lib.apply_preset(c.model, 'qwen3_1p7b')  # Qwen/Qwen3-1.7B; init_from supplies the weights.
  c.stage = 'pretrain'
  c.init_from = 'Qwen3-1.7B'  # a Hugging Face directory (or a dlmjax run) of the AR model
  c.output_dir = 'runs/adapt_block_qwen3'
  c.data.source = 'megatron'
  c.data.packing = True  # documents never see each other, in either stream
  c.diffusion.objective = 'block'
  c.diffusion.varlen_prob = 0.0
  c.model.attention_mask = 'block_causal'
  c.model.block_size = 4  # SDAR's continued pre-training block; raise it (8-32) in a later SFT
  c.model.mask_token_id = SDAR_MASK_TOKEN_ID
  c.model.seq_len = 2048
  c.model.dtype = 'bfloat16'
  c.model.attention_backend = 'auto'  # the Pallas kernel on GPU (cuDNN cannot take the mask)
  c.model.norm_backend = 'auto'
  c.model.remat = 'save_dots_attention'  # the layers run on 2 x seq_len tokens
  c.train.steps = 10_000  # 256 x 2048 tokens a step: 5.2B tokens; SDAR used 50B
  c.train.global_batch_size = 256
  c.train.micro_batch_size = 8
  c.train.lr = 1e-5
  c.train.min_lr = 1e-5
  c.train.schedule = 'constant'
  c.train.warmup_steps = 300  # 3% warmup (SDAR: constant_with_warmup, warmup_ratio 0.03)
  c.train.wsd_decay_steps = 0
  c.train.weight_decay = 0.1
  c.train.clip_grad_norm = 1.0
  c.checkpoint.every = 1000
  c.log.every = 20
  if arg == 'smoke':
    config_lib.apply_preset(c.model, 'tiny')
    c.init_from = 'runs/tiny_ar'
    c.output_dir = 'runs/adapt_block_tiny'
    c.data.source = 'builtin'
    c.data.packing = False
    c.model.vocab_size, c.model.mask_token_id, c.model.eos_token_id = 4096, 3, 2
    c.model.pad_token_id = 0
    c.model.attention_mask, c.model.block_size = 'block_causal', 4
    c.model.dtype, c.model.attention_backend, c.model.norm_backend = 'float32', 'xla', 'xla'
    c.model.remat = 'none'
    c.train.steps, c.train.warmup_steps = 40, 2
    c.train.global_batch_size, c.train.micro_batch_size = 32, 16
    c.train.lr = c.train.min_lr = 1e-3
    c.checkpoint.every, c.log.every = 0, 10
  elif arg:
    raise ValueError(f'configs/adapt_block_qwen3.py takes no argument or :smoke, got {arg!r}')
  return c
