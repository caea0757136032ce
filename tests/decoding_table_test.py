"""dlmjax/decoding_table.py: the settings, tokens per forward from commit steps, the speedups and
the verdict, by hand (the measuring itself runs in benchmarks.distill --tiny)."""

import numpy as np
import pytest

from dlmjax import decoding_table
from dlmjax.diffusion import sampling_config


def test_settings_are_none_first_then_each_rule_per_cache():
  base = sampling_config.SamplingConfig(gen_length=16, steps=16, block_length=8)
  settings = decoding_table.settings_of(
    base,
    thresholds=(0.9,),
    entropy_thresholds=(0.5,),
    caches=('none', 'dual'),
    block_add_thresholds=(0.1,),
  )
  assert list(settings) == [
    'none',
    'threshold 0.9',
    'entropy 0.5',
    'dual',
    'dual+threshold 0.9',
    'dual+entropy 0.5',
    'multi-block 0.1 entropy 0.5',
  ]
  m = settings['multi-block 0.1 entropy 0.5']
  assert (m.cache, m.block_add_threshold, m.entropy_threshold) == ('none', 0.1, 0.5)
  s = settings['dual+entropy 0.5']
  assert (s.cache, s.remasking, s.entropy_threshold, s.threshold) == ('dual', 'entropy', 0.5, 0)
  assert settings['none'].cache == 'none' and settings['threshold 0.9'].threshold == 0.9
  with pytest.raises(ValueError, match='cache'):
    decoding_table.settings_of(base, caches=('nope',))


def test_tokens_per_forward_counts_the_steps_that_committed():
  # row 0: 6 tokens in steps 0, 0, 1, 1, 1, 4 (3 steps); row 1: 6 tokens in 6 steps; -1 = prompt
  steps = np.array([[-1, 0, 0, 1, 1, 1, 4], [-1, 0, 1, 2, 3, 4, 5]])
  mean_steps, tpf = decoding_table.tpf_of(steps)
  assert mean_steps == pytest.approx(4.5) and tpf == pytest.approx(12 / 9)


def _row(model, setting, accuracy, tps, tpf=1.0):
  return dict(
    model=model,
    setting=setting,
    accuracy=accuracy,
    accuracy_se=0.01,
    tpf=tpf,
    steps=10.0,
    tokens_per_s=tps,
  )


def test_speedups_are_against_the_models_none_and_the_teachers():
  rows = decoding_table.with_speedups(
    [
      _row('teacher', 'none', 0.80, 100.0),
      _row('teacher', 'threshold 0.9', 0.80, 250.0, tpf=2.5),
      _row('certainty', 'none', 0.795, 120.0),
      _row('certainty', 'dual+entropy 0.5', 0.792, 960.0, tpf=6.0),
      _row('certainty', 'entropy 1', 0.60, 1500.0, tpf=9.0),
    ]
  )
  assert [r['speedup'] for r in rows] == [1.0, 2.5, 1.0, 8.0, 12.5]
  assert [r['vs_teacher'] for r in rows] == [1.0, 2.5, 1.2, 9.6, 15.0]
  table = decoding_table.table(rows)
  assert (
    'certainty | dual+entropy 0.5 | 0.792 +- 0.010 | 6.00 | 10.0 | 960.0 | 8.00 | 9.60' in table
  )
  verdict = decoding_table.verdict(rows)  # 'entropy 1' is 20 points down: left out
  assert 'highest TPF 6.00 (certainty dual+entropy 0.5, goal >= 4)' in verdict
  assert 'fastest 9.60x teacher none (certainty dual+entropy 0.5' in verdict
  rows[2]['accuracy'] = rows[3]['accuracy'] = 0.5
  assert 'no student setting within 1 point' in decoding_table.verdict(rows)
