"""tensorflow-datasets as a source: a TFDS split's text, tokenized once into an indexed dataset.

data.source = "tfds:NAME:SPLIT" reads the `text` feature of that split with tfds.data_source
(random access, no TensorFlow needed for array_record datasets), tokenizes it in the dataset's
order with data.tokenizer (or the built-in corpus's tokenizer), appends end-of-document and
writes a Megatron indexed dataset under data.cache_dir. Samples are then cut from it exactly as
from Megatron prefixes (GPTDataset, data.split), so order, epochs and the iterator state are the
same as for every other source. Meant for corpora that fit one tokenization pass on one host.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from dlmjax.data import indexed
from dlmjax.data import run_tokenizer
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError

PREFIX = 'tfds:'
TEXT_FEATURE = 'text'
FORMAT_VERSION = 1  # bump when tokenization or layout changes.
_CHUNK = 1024  # texts per encode_batch call.


def parse_source(source: str) -> tuple[str, str]:
  """'tfds:NAME:SPLIT' -> (NAME, SPLIT); NAME may carry a config and version (c4/en:3.1.0)."""
  parts = source.split(':')
  if len(parts) != 3 or parts[0] + ':' != PREFIX or not parts[1] or not parts[2]:
    raise DataError(f'data.source {source!r} is not tfds:NAME:SPLIT (e.g. tfds:lm1b:train).')
  return parts[1], parts[2]


def _tfds():
  try:
    import tensorflow_datasets  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise DataError(
      "data.source tfds:... needs tensorflow-datasets: pip install 'dlmjax[tfds]'."
    ) from e
  return tensorflow_datasets


def _file_key(path: str) -> list:
  stat = os.stat(path)
  return [os.path.abspath(path), stat.st_size, stat.st_mtime_ns]


def ensure_tfds_prefix(config, cache_dir: str) -> str:
  """The indexed-dataset prefix of config.data.source, tokenized on the first call and cached.

  The cache is keyed by the dataset, split, data_dir and tokenizer file; it is written in a
  temporary directory and renamed into place, so a killed run never leaves half a dataset.
  """
  name, split = parse_source(config.data.source)
  tfds = _tfds()
  tokenizer_path = run_tokenizer.find(config, build=True)
  data_dir = os.environ.get('TFDS_DATA_DIR') or None
  tok = tokenizer_lib.load_tokenizer(tokenizer_path, require_mask=False)
  if config.data.packing and tok.eod_id != config.model.eos_token_id:
    raise DataError(
      f'{tokenizer_path} ends documents with id {tok.eod_id} but '
      f'model.eos_token_id={config.model.eos_token_id}, which data.packing splits '
      f'documents at; set --config.model.eos_token_id={tok.eod_id}.'
    )
  key = json.dumps(
    [
      FORMAT_VERSION,
      name,
      split,
      data_dir and os.path.abspath(data_dir),
      _file_key(tok.path),
      tok.eod_id,
    ]
  )
  slug = f'{name}-{split}'.replace('/', '_').replace(':', '_')
  final = os.path.join(cache_dir, 'tfds', f'{slug}-{hashlib.md5(key.encode()).hexdigest()[:10]}')
  prefix = os.path.join(final, 'text_document')
  if os.path.isfile(os.path.join(final, 'meta.json')):
    return prefix
  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir)
  except Exception as e:  # tfds raises many kinds for a missing or unprepared dataset.
    raise DataError(
      f'cannot open TFDS dataset {name!r} split {split!r} (data_dir '
      f'{data_dir or "TFDS default"}): {e}. Prepare it with tfds (array_record '
      'format), or set the TFDS_DATA_DIR environment variable.'
    ) from e
  os.makedirs(os.path.dirname(final), exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f'.{slug}.tmp-', dir=os.path.dirname(final))
  try:
    num_tokens = 0
    with indexed.IndexedDatasetWriter(
      os.path.join(tmp, 'text_document'), indexed.optimal_dtype(tok.vocab_size)
    ) as writer:
      for start in range(0, len(source), _CHUNK):
        texts = [_text(source[i], name) for i in range(start, min(start + _CHUNK, len(source)))]
        for ids in tok.encode_batch(texts):
          writer.add_document(ids + [tok.eod_id])
          num_tokens += len(ids) + 1
    with open(os.path.join(tmp, 'meta.json'), 'w') as f:
      json.dump(dict(key=key, num_documents=len(source), num_tokens=num_tokens), f, indent=1)
    os.chmod(tmp, 0o755)
    try:
      os.rename(tmp, final)
    except OSError:  # a concurrent builder won: keep its identical copy.
      shutil.rmtree(tmp, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return prefix


def _text(example, name: str) -> str:
  if TEXT_FEATURE not in example:
    raise DataError(
      f'TFDS dataset {name!r} has no {TEXT_FEATURE!r} feature (it has '
      f'{sorted(example)}); only text datasets are supported.'
    )
  text = example[TEXT_FEATURE]
  return text.decode('utf-8', errors='replace') if isinstance(text, bytes) else str(text)
