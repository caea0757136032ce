"""TensorBoard scalar event files without TensorFlow: TFRecord framing and a hand-encoded proto.

A record is: uint64 length, uint32 masked_crc32c(length bytes), data, uint32 masked_crc32c(data)
(little-endian). Each record holds an `Event` proto {wall_time=1 double, step=2 int64,
file_version=3 string, summary=5 Summary{value=1 Value{tag=1 string, simple_value=2 float}}}.
TensorBoard reads simple_value scalars as it reads tf.summary.scalar ones. `read_scalars` is the
inverse, used by tests and by anyone without TensorBoard.
"""

from __future__ import annotations

import math
import numbers
import os
import socket
import struct
import time


def _crc32c_table() -> list[int]:
  table = []
  for n in range(256):
    crc = n
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
    table.append(crc)
  return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's mask: rotate right by 15 and add a constant, so CRCs of CRCs stay useful."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
  length = struct.pack('<Q', len(data))
  return (
    length
    + struct.pack('<I', masked_crc32c(length))
    + data
    + struct.pack('<I', masked_crc32c(data))
  )


# ----------------------------------------------------------------------------------------------
# Protocol buffer wire format, only the fields above.


def _varint(n: int) -> bytes:
  n &= 0xFFFFFFFFFFFFFFFF  # int64 wire form of negatives
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    out.append(byte | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
  return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_event(
  wall_time: float,
  step: int,
  *,
  scalars: dict[str, float] | None = None,
  file_version: str | None = None,
) -> bytes:
  event = b'\x09' + struct.pack('<d', wall_time) + b'\x10' + _varint(step)
  if file_version is not None:
    event += _length_delimited(3, file_version.encode())
  if scalars:
    values = b''.join(
      _length_delimited(1, _length_delimited(1, tag.encode()) + b'\x15' + struct.pack('<f', value))
      for tag, value in scalars.items()
    )
    event += _length_delimited(5, values)
  return event


class EventWriter:
  """Appends scalar events to `<log_dir>/events.out.tfevents.<time>.<host>`."""

  def __init__(self, log_dir: str):
    os.makedirs(log_dir, exist_ok=True)
    now = time.time()
    self.path = os.path.join(log_dir, f'events.out.tfevents.{int(now)}.{socket.gethostname()}')
    self._file = open(self.path, 'ab')
    self._file.write(frame(encode_event(now, 0, file_version='brain.Event:2')))
    self._file.flush()

  def scalars(self, step: int, values: dict[str, float]) -> None:
    """One event with every finite-or-not numeric value of `values` (bools and strings skipped)."""
    numeric = {
      k: float(v)
      for k, v in values.items()
      if isinstance(v, numbers.Real) and not isinstance(v, bool)
    }
    if numeric:
      self._file.write(frame(encode_event(time.time(), step, scalars=numeric)))
      self._file.flush()  # a preempted run keeps every row it logged

  def close(self) -> None:
    self._file.close()


# ----------------------------------------------------------------------------------------------
# Reading back


class CorruptEventFile(ValueError):
  pass


def read_records(path: str, *, stop_at_damage: bool = False) -> list[bytes]:
  """The records of a TFRecord file, each CRC checked; with stop_at_damage, the whole records
  before the first damaged one (a file whose writer was killed mid-record) instead of an error."""
  records = []
  with open(path, 'rb') as f:
    data = f.read()
  at = 0
  while at < len(data):
    problem = _record_problem(data, at)
    if problem:
      if stop_at_damage:
        break
      raise CorruptEventFile(f'{path}: {problem} at byte {at}')
    (length,) = struct.unpack('<Q', data[at : at + 8])
    records.append(data[at + 12 : at + 12 + length])
    at += 16 + length
  return records


def _record_problem(data: bytes, at: int) -> str | None:
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


def _fields(buf: bytes):
  """(field number, wire type, value) of a protobuf message; enough for Event/Summary/Value."""
  at = 0
  while at < len(buf):
    key, at = _read_varint(buf, at)
    field, wire = key >> 3, key & 7
    if wire == 0:
      value, at = _read_varint(buf, at)
    elif wire == 1:
      value, at = buf[at : at + 8], at + 8
    elif wire == 2:
      size, at = _read_varint(buf, at)
      value, at = buf[at : at + size], at + size
    elif wire == 5:
      value, at = buf[at : at + 4], at + 4
    else:
      raise CorruptEventFile(f'unsupported protobuf wire type {wire}')
    yield field, wire, value


def _read_varint(buf: bytes, at: int) -> tuple[int, int]:
  result = shift = 0
  while True:
    byte = buf[at]
    at += 1
    result |= (byte & 0x7F) << shift
    shift += 7
    if not byte & 0x80:
      return result, at


def decode_event(record: bytes) -> dict:
  event = dict(wall_time=math.nan, step=0, file_version=None, scalars={})
  for field, _, value in _fields(record):
    if field == 1:
      event['wall_time'] = struct.unpack('<d', value)[0]
    elif field == 2:
      event['step'] = value - (1 << 64) if value >= 1 << 63 else value
    elif field == 3:
      event['file_version'] = value.decode()
    elif field == 5:
      for _, _, summary_value in _fields(value):
        fields = {f: v for f, _, v in _fields(summary_value)}
        event['scalars'][fields[1].decode()] = struct.unpack('<f', fields[2])[0]
  return event


def read_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} of an event file."""
  out: dict[str, list[tuple[int, float]]] = {}
  for record in read_records(path):
    event = decode_event(record)
    for tag, value in event['scalars'].items():
      out.setdefault(tag, []).append((event['step'], value))
  return out
