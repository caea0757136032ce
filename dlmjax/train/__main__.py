"""python -m dlmjax.train --config=configs/<stage>.py [--config.a.b=value ...]"""

import sys

from absl import app
from ml_collections import config_flags

from dlmjax import config as config_lib
from dlmjax.checkpoint import manager as checkpoint_lib

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny.py',
                                          'A config file with get_config().', lock_config=True)


def main(argv):
  del argv
  # pylint: disable=import-outside-toplevel
  from dlmjax.data.indexed import DataError
  from dlmjax.train import loop
  try:
    loop.train(_CONFIG.value)
  except (config_lib.ConfigError, checkpoint_lib.CheckpointError, DataError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  app.run(main)
