"""The embedded default: a 5.5M-parameter masked-diffusion LM on the bundled Python-stdlib corpus.

    python -m dlmjax.train --config=configs/tiny.py

Needs no download and no GPU: the first run builds the corpus and a 4096-piece SentencePiece
tokenizer from the Python installation (cached in ~/.cache/dlmjax). On a 2-core CPU it trains its
120 steps in about 5 minutes (4 min 31 s measured on free cores, up to 12 on shared ones); the loss
falls from ~8.3 (uniform over 4096) to about 5.9.
Batch sizes divide by 8, so any 8-device mesh works, e.g. --config.mesh.fsdp=8 with
XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from dlmjax import config as config_lib


def get_config(arg=None):
  del arg
  c = config_lib.defaults()
  config_lib.apply_preset(c.model, 'tiny')
  c.output_dir = 'runs/tiny'
  c.train.steps = 120
  c.train.global_batch_size = 32
  c.train.micro_batch_size = 16
  c.train.lr = 3e-3
  c.train.min_lr = 3e-4
  c.train.warmup_steps = 10
  c.train.wsd_decay_steps = 24
  c.checkpoint.every = 60
  c.log.every = 10
  return c
