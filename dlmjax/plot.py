"""python -m dlmjax.plot RUN_DIR [--out DIR]: loss, throughput and reward PNGs from metrics.jsonl.

Reads only the run's metrics.jsonl, so it works on a copied run directory without JAX devices.
Training draws the same plots (dlmjax/observability/plots.py) into OUTPUT_DIR/plots at the end of
a run (plots in log.outputs).
"""

from __future__ import annotations

import argparse
import sys

from dlmjax import extras
from dlmjax.observability import plots


@extras.name_missing_extras('python -m dlmjax.plot')
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m dlmjax.plot', description=__doc__)
  parser.add_argument('run_dir', help='a training output_dir (holds metrics.jsonl)')
  parser.add_argument('--out', help='where to write the PNGs (default RUN_DIR/plots)')
  args = parser.parse_args(argv)
  try:
    for path in plots.draw(args.run_dir, args.out):
      print(path)
  except plots.PlotError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
