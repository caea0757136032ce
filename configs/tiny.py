"""The embedded default: a 1.9M-parameter masked-diffusion LM on the bundled Python-stdlib corpus.

    python -m dlmjax.train --config=configs/tiny.py

Needs no download and no GPU: the first run builds the corpus and a 4096-piece SentencePiece
tokenizer from the Python installation (cached in ~/.cache/dlmjax). On a 2-core CPU it trains its
360 steps in 3-5 minutes (3 min 21 s measured on nearly free cores, 4 min 31 s shared); the
loss falls from ~8.3 (uniform over 4096) through the unigram plateau (~6.2, steps 20-160) to about
5.4, and samples show Python's words and indentation.
The tiny preset narrowed to d_model 128: at equal wall time it takes 2.3x the steps of the d_model
256 preset, and the plateau is left by steps, not by width or learning rate (docs/benchmarks.md
"Tiny config on the CPU"). Batch sizes divide by 8, so any 8-device data/fsdp mesh works (tensor
at most 2, the head count), e.g. --config.mesh.fsdp=8 with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from dlmjax import config as config_lib


def get_config(arg=None):
  del arg
  c = config_lib.defaults()
  config_lib.apply_preset(c.model, 'tiny')
  c.model.d_model = 128
  c.model.num_heads = 2
  c.model.num_kv_heads = 2
  c.model.ffn_dim = 384
  c.output_dir = 'runs/tiny'
  c.train.steps = 360
  c.train.global_batch_size = 32
  c.train.micro_batch_size = 16
  c.train.lr = 3e-3
  c.train.min_lr = 3e-4
  c.train.warmup_steps = 10
  c.train.wsd_decay_steps = 24
  c.checkpoint.every = 120
  c.log.every = 20
  return c
