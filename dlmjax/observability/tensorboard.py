"""TensorBoard scalar event files, encoded and framed by the tensorboard package's own writer
pieces (its Event/Summary protobufs and its TFRecord RecordWriter), without TensorFlow.

Not tensorboardX: importing it imports torch whenever torch is installed (its writer module does,
unconditionally), which costs every training process seconds and hundreds of MB for nothing.
Not tensorboard's EventFileWriter either: it opens files through `tensorboard.compat.tf`, which
imports TensorFlow when that is installed, and it writes from a thread. Here each logged row is
one Event with all its scalars, appended and flushed in the caller's thread, so a preempted run
keeps every row it logged.

A record is: uint64 length, uint32 masked_crc32c(length bytes), data, uint32 masked_crc32c(data)
(little-endian). `read_records` checks both CRCs and can stop at a record a kill cut short, which
the resume's trimming (observability/history.py) needs; no maintained reader offers that.
"""

from __future__ import annotations

import numbers
import os
import socket
import struct
import time

from dlmjax import config as config_lib

_MISSING = (
  'log.outputs names tensorboard, which needs the tensorboard package (not installed): '
  '`pip install tensorboard` (a dependency of dlmjax: `pip install -e .` installs it), or leave '
  'tensorboard out of --config.log.outputs.'
)


def _library():
  """(RecordWriter, masked_crc32c, event_pb2, summary_pb2) of the tensorboard package."""
  try:
    # pylint: disable=import-outside-toplevel
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer import record_writer
  except ImportError as e:
    raise config_lib.ConfigError(_MISSING) from e
  return record_writer.RecordWriter, record_writer.masked_crc32c, event_pb2, summary_pb2


def check_installed() -> None:
  """Raises the one-line ConfigError when the tensorboard package is missing."""
  _library()


class EventWriter:
  """Appends scalar events to `<log_dir>/events.out.tfevents.<time>.<host>`."""

  def __init__(self, log_dir: str):
    record_writer, _, self._event_pb2, self._summary_pb2 = _library()
    os.makedirs(log_dir, exist_ok=True)
    now = time.time()
    self.path = os.path.join(log_dir, f'events.out.tfevents.{int(now)}.{socket.gethostname()}')
    # Append: a second writer started in the same second on the same host adds to the file.
    self._records = record_writer(open(self.path, 'ab'))
    self._write(self._event_pb2.Event(wall_time=now, step=0, file_version='brain.Event:2'))

  def _write(self, event) -> None:
    self._records.write(event.SerializeToString())
    self._records.flush()  # a preempted run keeps every row it logged

  def scalars(self, step: int, values: dict[str, float]) -> None:
    """One event with every finite-or-not numeric value of `values` (bools and strings skipped)."""
    numeric = [
      self._summary_pb2.Summary.Value(tag=k, simple_value=float(v))
      for k, v in values.items()
      if isinstance(v, numbers.Real) and not isinstance(v, bool)
    ]
    if numeric:
      summary = self._summary_pb2.Summary(value=numeric)
      self._write(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

  def close(self) -> None:
    self._records.close()


# ----------------------------------------------------------------------------------------------
# Reading back


class CorruptEventFile(ValueError):
  pass


def read_records(path: str, *, stop_at_damage: bool = False) -> list[bytes]:
  """The records of a TFRecord file, each CRC checked; with stop_at_damage, the whole records
  before the first damaged one (a file whose writer was killed mid-record) instead of an error."""
  _, masked_crc32c, _, _ = _library()
  records = []
  with open(path, 'rb') as f:
    data = f.read()
  at = 0
  while at < len(data):
    problem = _record_problem(data, at, masked_crc32c)
    if problem:
      if stop_at_damage:
        break
      raise CorruptEventFile(f'{path}: {problem} at byte {at}')
    (length,) = struct.unpack('<Q', data[at : at + 8])
    records.append(data[at + 12 : at + 12 + length])
    at += 16 + length
  return records


def _record_problem(data: bytes, at: int, masked_crc32c) -> str | None:
  if len(data) - at < 12:
    return 'truncated record header'
  header = data[at : at + 8]
  (length,) = struct.unpack('<Q', header)
  if struct.unpack('<I', data[at + 8 : at + 12])[0] != masked_crc32c(header):
    return 'bad length CRC'
  body = data[at + 12 : at + 12 + length]
  footer = data[at + 12 + length : at + 16 + length]
  if len(body) != length or len(footer) != 4:
    return 'truncated record'
  if struct.unpack('<I', footer)[0] != masked_crc32c(body):
    return 'bad data CRC'
  return None


def write_records(path: str, records: list[bytes]) -> None:
  """A new TFRecord file holding `records` (framed by the library's RecordWriter)."""
  record_writer, _, _, _ = _library()
  writer = record_writer(open(path, 'wb'))
  for record in records:
    writer.write(record)
  writer.close()


def decode_event(record: bytes):
  """The Event protobuf of a record (wall_time, step, file_version, summary.value[...])."""
  _, _, event_pb2, _ = _library()
  return event_pb2.Event.FromString(record)


def read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of an event file."""
  out: dict[str, list[tuple[int, float]]] = {}
  for record in read_records(path):
    event = decode_event(record)
    for value in event.summary.value:
      out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out
