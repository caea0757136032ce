"""python -m benchmarks.data_loader runs end to end and reports a rate."""

import os

from benchmarks import data_loader


def test_benchmark_prints_tokens_per_second(builtin_corpus, capsys):
  cache_dir = os.path.dirname(os.path.dirname(builtin_corpus.prefix))
  data_loader.main(
    ['--seq-len', '64', '--global-batch-size', '4', '--batches', '3', '--cache-dir', cache_dir]
  )
  assert 'tokens/s' in capsys.readouterr().out
