"""python -m dlmjax.train --config=configs/<stage>.py [--config.a.b=value ...]

On several hosts every process runs this same command; dlmjax.parallel.distributed reads the
launch environment (explicit, MegaDLMs' envs/.env, or SLURM) before any device is touched.
"""

from dlmjax import cli
from dlmjax.parallel import distributed
from dlmjax.train import loop


def main(argv, config):
  del argv
  distributed.initialize()
  loop.train(config)


if __name__ == '__main__':
  cli.run(main, config_file='configs/tiny.py')
