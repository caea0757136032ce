"""The event files against the TFRecord framing (a bit-by-bit CRC-32C checked on published
vectors), an independent protobuf parser and TensorBoard's own reader; the one-line message when
the tensorboard package is missing."""

import os
import struct
import sys

import numpy as np
import pytest

from dlmjax.observability import tensorboard


def _crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli, reflected), bit by bit: the reference for the files' framing."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc ^= byte
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
  return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
  crc = _crc32c(data)
  return ((((crc >> 15) | (crc << 17)) % 2**32) + 0xA282EAD8) % 2**32


def test_reference_crc32c_known_vectors():
  # RFC 3720 (iSCSI) appendix B.4 and the usual check value.
  assert _crc32c(b'123456789') == 0xE3069283
  assert _crc32c(bytes(32)) == 0x8A9136AA
  assert _crc32c(b'\xff' * 32) == 0x62A8AB43
  assert _crc32c(bytes(range(32))) == 0x46DD794E


def _write_random(tmp_path, rng):
  writer = tensorboard.EventWriter(str(tmp_path))
  expected = {}
  for step in rng.choice(10**6, size=12, replace=False):
    values = {
      'loss': float(rng.normal()),
      'lr': float(rng.uniform(0, 1e-3)),
      'reward_mean': float(rng.normal() * 1e4),
      'flag': True,
      'note': 'text',
    }
    writer.scalars(int(step), values)
    for key in ('loss', 'lr', 'reward_mean'):
      expected.setdefault(key, []).append((int(step), values[key]))
  writer.close()
  return writer.path, expected


def test_round_trip(tmp_path):
  path, expected = _write_random(tmp_path, np.random.default_rng(1))
  assert os.path.basename(path).startswith('events.out.tfevents.')
  scalars = tensorboard.read_scalars(path)
  assert sorted(scalars) == sorted(expected)  # bools and strings are not scalars
  for key, points in expected.items():
    assert [s for s, _ in scalars[key]] == [s for s, _ in points]
    np.testing.assert_array_equal([v for _, v in scalars[key]], np.float32([v for _, v in points]))
  first = tensorboard.decode_event(tensorboard.read_records(path)[0])
  assert first.file_version == 'brain.Event:2' and first.step == 0


def test_a_flipped_byte_is_detected(tmp_path):
  path, _ = _write_random(tmp_path, np.random.default_rng(2))
  with open(path, 'r+b') as f:
    f.seek(os.path.getsize(path) - 9)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(tensorboard.CorruptEventFile, match='bad data CRC'):
    tensorboard.read_records(path)


def _protobuf_event_class():
  """tensorflow/core/util/event.proto's Event, Summary and Summary.Value, built at run time."""
  from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

  fdp = descriptor_pb2.FileDescriptorProto(name='event_test.proto', package='t')
  F = descriptor_pb2.FieldDescriptorProto
  value = fdp.message_type.add(name='Value')
  value.field.add(name='tag', number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
  value.field.add(name='simple_value', number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
  summary = fdp.message_type.add(name='Summary')
  summary.field.add(
    name='value', number=1, type=F.TYPE_MESSAGE, type_name='.t.Value', label=F.LABEL_REPEATED
  )
  event = fdp.message_type.add(name='Event')
  event.field.add(name='wall_time', number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
  event.field.add(name='step', number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
  event.field.add(name='file_version', number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
  event.field.add(
    name='summary', number=5, type=F.TYPE_MESSAGE, type_name='.t.Summary', label=F.LABEL_OPTIONAL
  )
  pool = descriptor_pool.DescriptorPool()
  pool.Add(fdp)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName('t.Event'))


def test_records_parse_with_the_protobuf_library(tmp_path):
  pytest.importorskip('google.protobuf')
  event_class = _protobuf_event_class()
  path, expected = _write_random(tmp_path, np.random.default_rng(3))
  records = tensorboard.read_records(path)
  head = event_class.FromString(records[0])
  assert head.file_version == 'brain.Event:2'
  parsed = {}
  for record in records[1:]:
    event = event_class.FromString(record)
    assert event.wall_time > 1.6e9
    for value in event.summary.value:
      parsed.setdefault(value.tag, []).append((event.step, value.simple_value))
  for key, points in expected.items():
    assert [s for s, _ in parsed[key]] == [s for s, _ in points]
    np.testing.assert_array_equal([v for _, v in parsed[key]], np.float32([v for _, v in points]))
  # Negative steps use the int64 two's-complement varint.
  writer = tensorboard.EventWriter(str(tmp_path / 'negative'))
  writer.scalars(-5, {'loss': 1.0})
  writer.close()
  (record,) = tensorboard.read_records(writer.path)[1:]
  assert event_class.FromString(record).step == -5
  assert tensorboard.decode_event(record).step == -5


def test_tensorboard_reads_the_file(tmp_path):
  loader_module = pytest.importorskip('tensorboard.backend.event_processing.event_file_loader')
  path, expected = _write_random(tmp_path, np.random.default_rng(4))
  events = list(loader_module.EventFileLoader(path).Load())
  # The loader migrates simple_value scalars to tensor summaries (TensorBoard's data_compat).
  got = [
    (e.step, v.tag, v.simple_value if v.HasField('simple_value') else v.tensor.float_val[0])
    for e in events
    for v in e.summary.value
  ]
  want = [(s, k, np.float32(v)) for k, pts in expected.items() for s, v in pts]
  assert sorted(got) == sorted(want)


def test_frame_layout(tmp_path):
  """Every record: uint64 length, masked CRC-32C of those 8 bytes, the data, its masked CRC."""
  path, _ = _write_random(tmp_path, np.random.default_rng(5))
  with open(path, 'rb') as f:
    data = f.read()
  at = count = 0
  while at < len(data):
    header = data[at : at + 8]
    (length,) = struct.unpack('<Q', header)
    assert struct.unpack('<I', data[at + 8 : at + 12])[0] == _masked(header)
    body = data[at + 12 : at + 12 + length]
    assert struct.unpack('<I', data[at + 12 + length : at + 16 + length])[0] == _masked(body)
    at, count = at + 16 + length, count + 1
  assert at == len(data) and count == 13  # the file_version event and 12 rows


def test_missing_tensorboard_is_one_line_naming_the_fix(tmp_path, monkeypatch):
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.observability import sinks  # pylint: disable=import-outside-toplevel

  for key in [k for k in sys.modules if k == 'tensorboard' or k.startswith('tensorboard.')]:
    monkeypatch.setitem(sys.modules, key, None)
  monkeypatch.setitem(sys.modules, 'tensorboard', None)
  config = config_lib.defaults()
  with pytest.raises(config_lib.ConfigError, match='pip install tensorboard') as e:
    sinks.check_installed(config)
  assert '\n' not in str(e.value) and 'log.outputs' in str(e.value)
  with pytest.raises(config_lib.ConfigError, match='pip install tensorboard'):
    tensorboard.EventWriter(str(tmp_path))
  config.log.outputs = 'plots'
  sinks.check_installed(config)  # nothing to check without tensorboard
