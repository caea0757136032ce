"""python -m dlmjax.train --config=configs/<stage>.py [--config.a.b=value ...]

On several hosts every process runs this same command; dlmjax.parallel.distributed reads the
launch environment (explicit, MegaDLMs' envs/.env, or SLURM) before any device is touched.
"""

from ml_collections import config_flags

from dlmjax import cli
from dlmjax.parallel import distributed
from dlmjax.train import loop

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny.py',
                                          'A config file with get_config().', lock_config=True)


def main(argv):
  del argv
  distributed.initialize()
  loop.train(_CONFIG.value)


if __name__ == '__main__':
  cli.run(main)
