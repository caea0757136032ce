"""Measures the input pipeline's throughput in tokens/s, to check it never starves the devices.

    python -m benchmarks.data_loader --seq-len 2048 --global-batch-size 32 --batches 300
    python -m benchmarks.data_loader --source megatron --prefixes /data/foo_text_document \\
        --vocab-size 50304

Defaults to the built-in corpus, so it runs anywhere; index building is timed separately.
"""

from __future__ import annotations

import argparse
import time

from dlmjax import config as config_lib
from dlmjax.data import pipeline


def benchmark(config, batches: int) -> float:
  """Tokens per second delivered by make_batch_iterator over `batches` batches, after warm-up."""
  start = time.perf_counter()
  iterator = pipeline.make_batch_iterator(config)
  next(iterator)
  print(f'first batch (index build included) after {time.perf_counter() - start:.2f} s')
  tokens = 0
  start = time.perf_counter()
  for _ in range(batches):
    tokens += next(iterator)['tokens'].size
  seconds = time.perf_counter() - start
  iterator.close()
  return tokens / seconds


def main(argv=None):
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--source', default='builtin', choices=['builtin', 'megatron'])
  parser.add_argument('--prefixes', default='', help='Megatron blend, for --source megatron')
  parser.add_argument('--vocab-size', type=int, default=4096)
  parser.add_argument('--seq-len', type=int, default=2048)
  parser.add_argument('--global-batch-size', type=int, default=32)
  parser.add_argument('--batches', type=int, default=300)
  parser.add_argument('--workers', type=int, default=0)
  parser.add_argument('--prefetch', type=int, default=2)
  parser.add_argument('--cache-dir', default='')
  args = parser.parse_args(argv)
  c = config_lib.defaults()
  c.data.source, c.data.train_prefixes = args.source, args.prefixes
  c.data.cache_dir = args.cache_dir
  c.data.num_workers, c.data.prefetch = args.workers, args.prefetch
  c.model.vocab_size, c.model.seq_len = args.vocab_size, args.seq_len
  c.train.global_batch_size, c.train.steps = args.global_batch_size, args.batches + 1
  rate = benchmark(c, args.batches)
  print(
    f'{rate:,.0f} tokens/s ({rate / (args.seq_len + 1):,.0f} samples/s) at seq_len '
    f'{args.seq_len}, global batch {args.global_batch_size}, {args.workers} workers, '
    f'prefetch {args.prefetch}'
  )


if __name__ == '__main__':
  main()
