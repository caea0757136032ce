"""RunCheckpoints' resume-time integrity check: params against the checksums saved with them."""

import numpy as np
import pytest

from dlmjax.checkpoint import manager
from tests.checkpoint import tiny_run


def test_verify_accepts_the_saved_params_and_names_a_changed_one(tmp_path):
  _, params, _ = tiny_run.make_run(tmp_path)
  checkpoints = manager.RunCheckpoints(str(tmp_path))
  checkpoints._verify(0, params)  # pylint: disable=protected-access
  changed = dict(params, final_norm=dict(params['final_norm']))
  key = next(iter(changed['final_norm']))
  changed['final_norm'][key] = np.nextafter(params['final_norm'][key], np.inf)  # 1 ulp
  with pytest.raises(manager.CheckpointError, match=f'final_norm/{key}: sha256 differs'):
    checkpoints._verify(0, changed)  # pylint: disable=protected-access
  checkpoints.close()
  checkpoints.close()  # idempotent: the loop's error path may close again


def test_set_aside_renames_without_clobbering(tmp_path):
  tiny_run.make_run(tmp_path)
  checkpoints = manager.RunCheckpoints(str(tmp_path))
  (tmp_path / 'checkpoints' / '0.corrupt').mkdir()
  assert checkpoints._set_aside(0) == '0.corrupt1'  # pylint: disable=protected-access
  assert (tmp_path / 'checkpoints' / '0.corrupt1').is_dir()
  assert checkpoints.latest_step() is None
  checkpoints.close()
