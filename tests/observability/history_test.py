"""drop_rows_after: a resumed run's metrics.jsonl and TensorBoard files lose the rows past the
restored step (and a row cut short by a kill), nothing else."""

import json
import os

from dlmjax.observability import history, tensorboard


def test_rows_past_the_step_are_dropped_from_metrics_and_tensorboard(tmp_path):
  rows = [dict(step=s, loss=10.0 - s) for s in range(1, 6)] + [dict(step=3, val_loss=1.5)]
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
    f.write('{"step": 6, "lo')  # killed mid-line
  writer = tensorboard.EventWriter(str(tmp_path / 'tensorboard'))
  for s in range(1, 7):
    writer.scalars(s, {'loss': 10.0 - s})
  writer.close()
  with open(writer.path, 'r+b') as f:  # killed while writing step 6's record
    f.truncate(os.path.getsize(writer.path) - 3)
  assert history.drop_rows_after(str(tmp_path), 3) == 3  # steps 4, 5 and the cut line
  with open(tmp_path / 'metrics.jsonl') as f:
    assert [json.loads(line) for line in f] == rows[:3] + rows[5:]
  assert tensorboard.read_scalars(writer.path)['loss'] == [(1, 9.0), (2, 8.0), (3, 7.0)]
  assert history.drop_rows_after(str(tmp_path), 3) == 0  # nothing left to drop
  assert history.drop_rows_after(str(tmp_path / 'absent'), 3) == 0
