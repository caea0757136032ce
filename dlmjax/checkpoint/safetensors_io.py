"""Streaming safetensors: write a sharded model one tensor at a time, read tensors lazily.

The safetensors library writes a whole dict at once; a 1.7B export would then hold a full shard
(up to --max-shard-size) in memory beside the model. The format is simple (an 8-byte little-endian
header length, a JSON header of dtypes, shapes and byte offsets, then the raw bytes), so we plan
each shard's header from the shapes up front and append tensors as they are produced. Pure numpy:
no torch or safetensors needed to convert. Files are checked against the safetensors library and
transformers in tests.
"""

from __future__ import annotations

import json
import os
import re
import struct

import ml_dtypes
import numpy as np

from dlmjax.checkpoint import hf_dir

# transformers' names of the weights files (a Hugging Face directory is recognised by them)
SINGLE_FILE = hf_dir.SINGLE_FILE
INDEX_FILE = hf_dir.INDEX_FILE
_DTYPES = {
  'F64': np.dtype(np.float64),
  'F32': np.dtype(np.float32),
  'F16': np.dtype(np.float16),
  'BF16': np.dtype(ml_dtypes.bfloat16),
  'I64': np.dtype(np.int64),
  'I32': np.dtype(np.int32),
  'I16': np.dtype(np.int16),
  'I8': np.dtype(np.int8),
  'U8': np.dtype(np.uint8),
  'BOOL': np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_UNITS = {
  '': 1,
  'B': 1,
  'KB': 10**3,
  'MB': 10**6,
  'GB': 10**9,
  'TB': 10**12,
  'KIB': 2**10,
  'MIB': 2**20,
  'GIB': 2**30,
  'TIB': 2**40,
}


class SafetensorsError(ValueError):
  """A safetensors file or directory that cannot be read as one model."""


def parse_size(text: str | int) -> int:
  """Bytes in '5GB' (decimal, as Hugging Face counts), '512MiB' or a plain integer."""
  if isinstance(text, int):
    return text
  match = re.fullmatch(r'\s*([0-9.]+)\s*([a-zA-Z]*)\s*', text)
  if not match or match.group(2).upper() not in _UNITS:
    raise ValueError(f'cannot read the size {text!r}; write it like 5GB, 500MB or 2GiB.')
  return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _header_bytes(entries, metadata) -> bytes:
  """JSON header padded with spaces to a multiple of 8 bytes (as the library aligns it)."""
  header = {'__metadata__': dict(metadata or {})}
  offset = 0
  for name, shape, dtype in entries:
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    header[name] = dict(
      dtype=_NAMES[dtype], shape=list(shape), data_offsets=[offset, offset + size]
    )
    offset += size
  raw = json.dumps(header, separators=(',', ':')).encode()
  return raw + b' ' * (-len(raw) % 8)


def plan_shards(entries, max_shard_bytes: int) -> list[list[tuple]]:
  """Greedy split of (name, shape, dtype) entries, in order, into shards under the size limit."""
  shards, current, size = [], [], 0
  for entry in entries:
    nbytes = int(np.prod(entry[1], dtype=np.int64)) * entry[2].itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(entry)
    size += nbytes
  if current:
    shards.append(current)
  return shards


def write_model(
  directory: str, entries, tensors, *, max_shard_bytes: int, metadata=None, single_file=SINGLE_FILE
) -> list:
  """Writes `tensors` ((name, array) pairs, in the order of `entries`) as one or more shards.

  `entries` are (name, shape, numpy dtype) planned in advance; each arriving array is checked
  against its entry and written straight to disk. With several shards, an index maps names to
  files (`model.safetensors.index.json`, as transformers' save_pretrained writes). Returns the
  file names. `single_file` names a one-shard file (PEFT's is adapter_model.safetensors).
  """
  os.makedirs(directory, exist_ok=True)
  shards = plan_shards(list(entries), max_shard_bytes)
  names = (
    [single_file]
    if len(shards) == 1
    else [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))]
  )
  iterator = iter(tensors)
  weight_map, total = {}, 0
  for shard, file_name in zip(shards, names):
    path = os.path.join(directory, file_name)
    header = _header_bytes(shard, metadata)
    with open(path + '.partial', 'wb') as f:
      f.write(struct.pack('<Q', len(header)))
      f.write(header)
      for name, shape, dtype in shard:
        got_name, array = next(iterator, (None, None))
        if got_name != name or tuple(array.shape) != tuple(shape) or array.dtype != dtype:
          got = None if array is None else (tuple(array.shape), array.dtype)
          raise SafetensorsError(
            f'expected tensor {name} {tuple(shape)} {dtype}, got '
            f'{got_name} {got}: the tensor stream and its plan disagree.'
          )
        np.ascontiguousarray(array).tofile(f)
        weight_map[name] = file_name
        total += array.nbytes
        del array  # freed before the next tensor is produced: one tensor on the host at a time.
    os.replace(path + '.partial', path)  # a crash never leaves a plausible-looking shard.
  if next(iterator, None) is not None:
    raise SafetensorsError('more tensors arrived than were planned.')
  if len(shards) > 1:
    with open(os.path.join(directory, INDEX_FILE), 'w') as f:
      json.dump(dict(metadata=dict(total_size=total), weight_map=weight_map), f, indent=2)
  return names


def _read_header(path):
  with open(path, 'rb') as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise SafetensorsError(f'{path} is truncated (no header).')
    (length,) = struct.unpack('<Q', prefix)
    raw = f.read(length)
  if len(raw) < length:
    raise SafetensorsError(f'{path} is truncated (header cut short).')
  try:
    header = json.loads(raw)
  except json.JSONDecodeError as e:
    raise SafetensorsError(f'{path} has an unreadable header ({e}).') from e
  header.pop('__metadata__', None)
  data_size = os.path.getsize(path) - 8 - length
  end = max((v['data_offsets'][1] for v in header.values()), default=0)
  if end > data_size:
    raise SafetensorsError(
      f'{path} is truncated: its header needs {end} bytes of data, the file '
      f'has {data_size}. Was the write interrupted?'
    )
  return 8 + length, header


class SafetensorsReader:
  """The tensors of a file or a Hugging Face directory (one file, or shards with an index)."""

  def __init__(self, path: str):
    self._files = {}  # tensor name -> (file path, data start, header entry)
    if os.path.isdir(path):
      index = os.path.join(path, INDEX_FILE)
      if os.path.exists(index):
        with open(index) as f:
          files = sorted(set(json.load(f)['weight_map'].values()))
      elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
      else:
        files = sorted(n for n in os.listdir(path) if n.endswith('.safetensors'))
      if not files:
        raise SafetensorsError(f'{path} holds no .safetensors files.')
      paths = [os.path.join(path, n) for n in files]
    else:
      paths = [path]
    for file_path in paths:
      if not os.path.exists(file_path):
        raise SafetensorsError(f'{file_path} is listed in the index but missing.')
      start, header = _read_header(file_path)
      for name, entry in header.items():
        if entry['dtype'] not in _DTYPES:
          raise SafetensorsError(
            f'{name} in {file_path} has dtype {entry["dtype"]}, which this '
            f'reader does not know ({sorted(_DTYPES)}).'
          )
        self._files[name] = (file_path, start, entry)

  def keys(self) -> list[str]:
    return list(self._files)

  def __contains__(self, name) -> bool:
    return name in self._files

  def shape(self, name) -> tuple:
    return tuple(self._files[name][2]['shape'])

  def dtype(self, name) -> np.dtype:
    return _DTYPES[self._files[name][2]['dtype']]

  def get(self, name) -> np.ndarray:
    """One tensor, read from disk into its own array (nothing else is loaded)."""
    path, start, entry = self._files[name]
    begin, end = entry['data_offsets']
    dtype = _DTYPES[entry['dtype']]
    with open(path, 'rb') as f:
      f.seek(start + begin)
      array = np.fromfile(f, dtype=np.uint8, count=end - begin)
    return array.view(dtype).reshape(entry['shape'])
