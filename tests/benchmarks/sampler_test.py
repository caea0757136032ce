"""python -m benchmarks.sampler: one JSON line per mode, bad modes refused."""

import json

from benchmarks import sampler
from tests.checkpoint import tiny_run


def test_bench_prints_tokens_per_second(tmp_path, capsys):
  tiny_run.make_run(tmp_path / 'run')
  args = [
    '--checkpoint-path',
    str(tmp_path / 'run'),
    '--batch',
    '2',
    '--prompt-length',
    '4',
    '--gen-length',
    '8',
    '--steps',
    '4',
    '--block-length',
    '4',
    '--repeats',
    '1',
  ]
  assert sampler.main(args + ['--modes', 'plain,truncate']) == 0  # truncate: bidirectional
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [r['mode'] for r in rows] == ['plain']
  assert rows[0]['tokens_per_s'] > 0 and rows[0]['vs_plain'] == 1.0
  assert sampler.main(args + ['--modes', 'plain,turbo']) == 2
  assert 'unknown modes' in capsys.readouterr().err
