"""Streaming safetensors: sharding, the index, bf16, truncation, and the official reader agrees."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from dlmjax.checkpoint import safetensors_io

TENSORS = [
  ('a', np.arange(12, dtype=np.float32).reshape(3, 4)),
  ('b.weight', np.linspace(-1, 1, 10).astype(ml_dtypes.bfloat16)),
  ('c', np.ones((2, 2, 2), np.float32)),
]


def _write(directory, max_bytes, tensors=TENSORS):
  entries = [(n, a.shape, a.dtype) for n, a in tensors]
  return safetensors_io.write_model(
    str(directory), entries, iter(tensors), max_shard_bytes=max_bytes, metadata={'format': 'pt'}
  )


@pytest.mark.parametrize('max_bytes, files', [(10**9, 1), (50, 3)])
def test_write_then_read(tmp_path, max_bytes, files):
  names = _write(tmp_path, max_bytes)
  assert len(names) == files
  assert os.path.exists(tmp_path / safetensors_io.INDEX_FILE) == (files > 1)
  reader = safetensors_io.SafetensorsReader(str(tmp_path))
  assert reader.keys() == [n for n, _ in TENSORS]
  for name, array in TENSORS:
    assert reader.dtype(name) == array.dtype and reader.shape(name) == array.shape
    np.testing.assert_array_equal(reader.get(name), array)
  if files > 1:
    index = json.loads((tmp_path / safetensors_io.INDEX_FILE).read_text())
    assert index['metadata']['total_size'] == sum(a.nbytes for _, a in TENSORS)


def test_official_reader_agrees(tmp_path):
  safetensors = pytest.importorskip('safetensors')
  _write(tmp_path, 10**9)
  with safetensors.safe_open(str(tmp_path / 'model.safetensors'), framework='numpy') as f:
    assert f.metadata() == {'format': 'pt'}
    for name, array in TENSORS:
      np.testing.assert_array_equal(f.get_tensor(name), array)


def test_stream_must_follow_its_plan(tmp_path):
  entries = [(n, a.shape, a.dtype) for n, a in TENSORS]
  with pytest.raises(safetensors_io.SafetensorsError, match='expected tensor b.weight'):
    safetensors_io.write_model(
      str(tmp_path), entries, iter([TENSORS[0], TENSORS[2]]), max_shard_bytes=10**9
    )


def test_truncated_file_is_reported(tmp_path):
  _write(tmp_path, 10**9)
  path = tmp_path / 'model.safetensors'
  path.write_bytes(path.read_bytes()[:-8])
  with pytest.raises(safetensors_io.SafetensorsError, match='truncated'):
    safetensors_io.SafetensorsReader(str(tmp_path))


def test_parse_size():
  assert safetensors_io.parse_size('5GB') == 5 * 10**9
  assert safetensors_io.parse_size('2GiB') == 2 * 2**30
  assert safetensors_io.parse_size('100') == 100
  with pytest.raises(ValueError, match='5GB'):
    safetensors_io.parse_size('five')
