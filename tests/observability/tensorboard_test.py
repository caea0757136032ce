"""The event-file writer against published CRC-32C vectors, an independent protobuf parser and,
when installed, TensorBoard's own reader."""

import os
import struct

import numpy as np
import pytest

from dlmjax.observability import tensorboard


def test_crc32c_known_vectors():
  # RFC 3720 (iSCSI) appendix B.4 and the usual check value.
  assert tensorboard.crc32c(b'123456789') == 0xE3069283
  assert tensorboard.crc32c(bytes(32)) == 0x8A9136AA
  assert tensorboard.crc32c(b'\xff' * 32) == 0x62A8AB43
  assert tensorboard.crc32c(bytes(range(32))) == 0x46DD794E
  assert tensorboard.crc32c(b'') == 0


def test_masked_crc_is_the_tfrecord_formula():
  rng = np.random.default_rng(0)
  for _ in range(20):
    data = rng.bytes(int(rng.integers(0, 64)))
    crc = tensorboard.crc32c(data)
    rotated = ((crc >> 15) | (crc << 17)) % 2**32
    assert tensorboard.masked_crc32c(data) == (rotated + 0xA282EAD8) % 2**32


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
  assert first['file_version'] == 'brain.Event:2' and first['step'] == 0


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
  assert event_class.FromString(tensorboard.encode_event(0.0, -5)).step == -5
  assert tensorboard.decode_event(tensorboard.encode_event(0.0, -5))['step'] == -5


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


def test_frame_layout():
  framed = tensorboard.frame(b'abc')
  assert struct.unpack('<Q', framed[:8])[0] == 3 and framed[12:15] == b'abc'
  assert len(framed) == 8 + 4 + 3 + 4
