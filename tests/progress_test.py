"""The console progress bar (tqdm): drawn on a terminal, silent elsewhere, gone when closed."""

import io

from dlmjax.observability import progress


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_bar_draws_counts_and_suffix_from_where_it_starts():
  stream = _Terminal()
  bar = progress.Bar(10, 'train', stream=stream, min_interval_s=0.0)
  bar.update(3, 'loss 1.0')  # a resumed run: the bar starts at step 3
  bar.update(10)
  text = stream.getvalue()
  assert 'train' in text and '3/10' in text and '10/10' in text and 'loss 1.0' in text
  assert '\n' not in text  # redrawn in place
  bar.close()


def test_bar_is_silent_off_a_terminal():
  stream = io.StringIO()  # isatty() is False
  bar = progress.Bar(5, stream=stream)
  bar.update(2)
  bar.close()
  assert stream.getvalue() == '' and not bar.enabled


def test_track_yields_everything_and_clears_its_line():
  stream = _Terminal()
  assert list(progress.track(range(0, 10, 4), 'score', stream=stream)) == [0, 4, 8]
  assert 'score' in stream.getvalue() and '/3' in stream.getvalue()
  assert stream.getvalue().endswith('\r')  # cleared for the next printed line
  quiet = io.StringIO()
  assert list(progress.track(iter('ab'), 'export', total=2, stream=quiet)) == ['a', 'b']
  assert quiet.getvalue() == ''
