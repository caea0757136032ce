"""The MMIDIDX reader and writer against bytes built by hand from Megatron's layout."""

import pickle
import struct

import numpy as np
import pytest

from dlmjax.data import indexed
from dlmjax.data.errors import DataError

DOCS = [[5, 6, 7], [8], [9, 10]]


def _spec_bytes(docs, code, fmt):
  """The .bin and .idx Megatron writes for one sequence per document, from the spec."""
  lengths = [len(d) for d in docs]
  itemsize = struct.calcsize(fmt)
  data = b''.join(struct.pack('<' + fmt * len(d), *d) for d in docs)
  pointers = [sum(lengths[:i]) * itemsize for i in range(len(docs))]
  idx = b'MMIDIDX\x00\x00' + struct.pack('<Q', 1) + struct.pack('<B', code)
  idx += struct.pack('<Q', len(docs)) + struct.pack('<Q', len(docs) + 1)
  idx += struct.pack(f'<{len(docs)}i', *lengths)
  idx += struct.pack(f'<{len(docs)}q', *pointers)
  idx += struct.pack(f'<{len(docs) + 1}q', *range(len(docs) + 1))
  return data, idx


def _write(prefix, docs, dtype=np.uint16):
  with indexed.IndexedDatasetWriter(str(prefix), dtype) as writer:
    for d in docs:
      writer.add_document(d)
  return str(prefix)


@pytest.mark.parametrize('dtype,code,fmt', [(np.uint16, 8, 'H'), (np.int32, 4, 'i')])
def test_writer_is_byte_identical_to_the_spec(tmp_path, dtype, code, fmt):
  prefix = _write(tmp_path / 'd', DOCS, dtype)
  data, idx = _spec_bytes(DOCS, code, fmt)
  assert open(prefix + '.bin', 'rb').read() == data
  assert open(prefix + '.idx', 'rb').read() == idx


def test_reader_reads_spec_bytes(tmp_path):
  data, idx = _spec_bytes(DOCS, 4, 'i')
  (tmp_path / 'd.bin').write_bytes(data)
  (tmp_path / 'd.idx').write_bytes(idx)
  ds = indexed.IndexedDataset(str(tmp_path / 'd'))
  assert len(ds) == 3 and ds.dtype == np.int32 and ds.num_tokens == 6
  assert [list(ds[i]) for i in range(3)] == DOCS
  assert list(ds.get(0, offset=1, length=2)) == [6, 7]
  assert list(ds.get(2, offset=1)) == [10]
  assert list(ds.sequence_lengths) == [3, 1, 2]
  assert list(ds.document_indices) == [0, 1, 2, 3]
  with pytest.raises(IndexError):
    ds.get(0, offset=2, length=2)


def test_empty_document_adds_a_boundary_but_no_sequence(tmp_path):
  prefix = str(tmp_path / 'd')
  with indexed.IndexedDatasetWriter(prefix) as writer:
    writer.add_document([1, 2])
    writer.add_document([])
    writer.add_document([3, 4, 5], lengths=[1, 2])
  ds = indexed.IndexedDataset(prefix)
  assert list(ds.sequence_lengths) == [2, 1, 2]
  assert list(ds.document_indices) == [0, 1, 1, 3]
  assert list(ds[2]) == [4, 5]


def test_pickle_reopens_by_path(tmp_path):
  ds = pickle.loads(pickle.dumps(indexed.IndexedDataset(_write(tmp_path / 'd', DOCS))))
  assert list(ds[0]) == [5, 6, 7]


def test_optimal_dtype():
  assert indexed.optimal_dtype(50304) == np.uint16
  assert indexed.optimal_dtype(65500) == np.int32


def _corrupt(tmp_path, offset, value):
  prefix = _write(tmp_path / 'd', DOCS)
  raw = bytearray(open(prefix + '.idx', 'rb').read())
  raw[offset : offset + len(value)] = value
  open(prefix + '.idx', 'wb').write(bytes(raw))
  return prefix


@pytest.mark.parametrize(
  'offset,value,message',
  [
    (0, b'TNTIDX\x00\x00\x00', 'legacy'),
    (0, b'XXXX', 'not a Megatron MMIDIDX index'),
    (9, struct.pack('<Q', 2), 'index version 2'),
    (17, struct.pack('<B', 9), 'unknown dtype code 9'),
    (34 + 3 * 12 + 3 * 8, struct.pack('<q', 2), 'document index ends at 2'),
    # Damage inside the arrays (lengths at 34, pointers at 46, document index at 70): each
    # would change the sample stream from step 1 or fail thousands of samples later.
    (34, struct.pack('<i', -1), 'sequence 0 has length -1'),
    (38, struct.pack('<i', 5), r'sequence 2 starts at byte 8, but sequence 1 \(5 tokens'),
    (54, struct.pack('<q', 100), 'sequence 1 starts at byte 100'),
    (46, struct.pack('<q', 2), 'sequence 0 starts at byte 2, not 0'),
    (78, struct.pack('<q', 7), r'document boundary 2 \(2\) is below the one before it \(7\)'),
    (70, struct.pack('<q', 1), 'document index starts at 1'),
  ],
)
def test_corrupt_index_errors(tmp_path, offset, value, message):
  prefix = _corrupt(tmp_path, offset, value)
  with pytest.raises(DataError, match=message) as e:
    indexed.IndexedDataset(prefix)
  assert 'd.idx' in str(e.value)


def test_index_consistency_check_covers_chunk_boundaries(tmp_path, monkeypatch):
  """The check runs in chunks: a bad pointer right after a chunk's end is still found."""
  monkeypatch.setattr(indexed, '_CHECK_CHUNK', 2)
  prefix = _write(tmp_path / 'd', DOCS * 2)  # 6 sequences: chunks [0, 2), [2, 4), [4, 6)
  indexed.IndexedDataset(prefix)
  raw = bytearray(open(prefix + '.idx', 'rb').read())
  raw[34 + 6 * 4 + 2 * 8 : 34 + 6 * 4 + 3 * 8] = struct.pack('<q', 9)  # sequence 2's pointer
  open(prefix + '.idx', 'wb').write(bytes(raw))
  with pytest.raises(DataError, match='sequence 2 starts at byte 9'):
    indexed.IndexedDataset(prefix)


def test_truncated_bin_and_missing_prefix(tmp_path):
  prefix = _write(tmp_path / 'd', DOCS)
  open(prefix + '.bin', 'ab').write(b'\x00')
  with pytest.raises(DataError, match=r'd\.bin has 13 bytes .* 6 uint16 tokens'):
    indexed.IndexedDataset(prefix)
  with pytest.raises(DataError, match=r'nope\.idx and .*nope\.bin not found.*dlmjax\.preprocess'):
    indexed.IndexedDataset(str(tmp_path / 'nope'))


def test_writer_rejects_ids_that_do_not_fit_and_aborts(tmp_path):
  prefix = str(tmp_path / 'd')
  with pytest.raises(DataError, match='optimal_dtype'):
    with indexed.IndexedDatasetWriter(prefix, np.uint16) as writer:
      writer.add_document(np.array([70000], np.int64))
  assert not (tmp_path / 'd.bin').exists() and not (tmp_path / 'd.idx').exists()
