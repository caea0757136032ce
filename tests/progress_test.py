"""The console progress bar: drawn in place on a terminal, silent elsewhere."""

import io

import numpy as np

from dlmjax import progress


def test_render_matches_a_hand_formula():
  rng = np.random.default_rng(0)
  for _ in range(50):
    total = int(rng.integers(1, 500))
    done = int(rng.integers(-3, total + 4))
    width = int(rng.integers(5, 40))
    line = progress.render(done, total, width=width, prefix='p', suffix='s')
    clamped = min(max(done, 0), total)
    filled = width * clamped // total
    assert line == f'p [{"#" * filled}{"." * (width - filled)}] {clamped}/{total} s'


def test_bar_draws_in_place_and_clears():
  stream = io.StringIO()
  bar = progress.Bar(10, 'train', stream=stream, enabled=True, min_interval_s=0.0)
  bar.update(3, 'loss 1.0')
  bar.update(10)
  text = stream.getvalue()
  assert text.count('\r') == 2 and 'train [' in text and '3/10 loss 1.0' in text
  assert '10/10' in text and '\n' not in text
  bar.close()
  assert stream.getvalue().endswith('\r')


def test_bar_is_silent_off_a_terminal():
  stream = io.StringIO()  # isatty() is False
  bar = progress.Bar(5, stream=stream)
  bar.update(2)
  bar.close()
  assert stream.getvalue() == '' and not bar.enabled


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_track_yields_everything_and_draws_the_last_count():
  stream = _Terminal()
  assert list(progress.track(range(0, 10, 4), 'score', stream=stream)) == [0, 4, 8]
  assert 'score [' in stream.getvalue() and '3/3' in stream.getvalue()
  assert stream.getvalue().endswith('\r')  # cleared for the next printed line
  assert list(progress.track(iter('ab'), 'export', total=2, stream=io.StringIO())) == ['a', 'b']
