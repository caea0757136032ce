"""python -m dlmjax.train --config=configs/<stage>.py [--config.a.b=value ...]"""

from ml_collections import config_flags

from dlmjax import cli

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny.py',
                                          'A config file with get_config().', lock_config=True)


def main(argv):
  del argv
  from dlmjax.train import loop  # pylint: disable=import-outside-toplevel
  loop.train(_CONFIG.value)


if __name__ == '__main__':
  cli.run(main)
