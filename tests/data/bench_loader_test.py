"""The loader benchmark runs end to end and reports a rate."""

import os

from dlmjax.data import bench_loader


def test_benchmark_prints_tokens_per_second(builtin_corpus, capsys):
  cache_dir = os.path.dirname(os.path.dirname(builtin_corpus.prefix))
  bench_loader.main(['--seq-len', '64', '--global-batch-size', '4', '--batches', '3',
                     '--cache-dir', cache_dir])
  assert 'tokens/s' in capsys.readouterr().out
