"""python -m dlmjax.demo: the command line is dlmjax/demo/command.py."""

import sys

from dlmjax.demo import command

if __name__ == '__main__':
  sys.exit(command.main())
