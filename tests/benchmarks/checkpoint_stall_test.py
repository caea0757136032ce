"""The checkpoint-stall benchmark's configs are valid runs, at the GPU shape too.

The 1.7B run is only ever launched on the H200, so a config it cannot run (a special id outside its
vocabulary) would first show there, after minutes of lease; validating it here costs milliseconds.
"""

import argparse

import pytest

from benchmarks import checkpoint_stall
from dlmjax import config as config_lib


@pytest.mark.parametrize('tiny', [False, True], ids=['gpu_shape', 'tiny'])
def test_config_validates(tiny, tmp_path):
  args = argparse.Namespace(
    tiny=tiny,
    output_dir=str(tmp_path),
    steps=12,
    every=2,
    global_batch_size=0,
    micro_batch_size=0,
  )
  config = checkpoint_stall.make_config(args)
  config_lib.validate(config, num_devices=1)
  assert config.model.mask_token_id < config.model.vocab_size
