"""One tokenizer interface over SentencePiece `.model` and Hugging Face `tokenizer.json` files.

A masked diffusion LM needs three special ids beyond the vocabulary: end of document (appended to
every document), mask (what the forward process writes) and padding. They are resolved here once,
from the tokenizer's own pieces or from explicit overrides, so nothing downstream guesses.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from typing import Iterable, Iterator, Sequence

from dlmjax.data.errors import DataError

EOD_PIECES = ('<|endoftext|>', '</s>', '<eos>', '<|end_of_text|>', '<|eot_id|>')
MASK_PIECES = ('<|mask|>', '<|mask_token|>', '<|mdm_mask|>', '<mask>', '[MASK]')
PAD_PIECES = ('<|padding|>', '<pad>', '<|pad|>', '[PAD]')


class _SentencePiece:
  """A SentencePiece model; adds no BOS/EOS when encoding, as Megatron's wrapper does."""

  def __init__(self, path):
    import sentencepiece  # pylint: disable=import-outside-toplevel

    self.model = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self.model.get_piece_size()
    self.default_eod = self.model.eos_id() if self.model.eos_id() >= 0 else None

  def piece_id(self, piece):
    i = self.model.piece_to_id(piece)  # unknown pieces map to unk: check the round trip.
    return i if self.model.id_to_piece(i) == piece else None

  def id_piece(self, i):
    return self.model.id_to_piece(i)

  def encode(self, text):
    return self.model.encode(text)

  def encode_batch(self, texts):
    return self.model.encode(list(texts), num_threads=os.cpu_count() or 1)

  def decode(self, ids):
    return self.model.decode(list(ids))


class _HuggingFace:
  """A `tokenizers` tokenizer.json; encodes as `tokenizer(text).input_ids`, which Megatron uses."""

  def __init__(self, path):
    import tokenizers  # pylint: disable=import-outside-toplevel

    self.model = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)
    self.default_eod = None

  def piece_id(self, piece):
    return self.model.token_to_id(piece)

  def id_piece(self, i):
    return self.model.id_to_token(i)

  def encode(self, text):
    return self.model.encode(text).ids

  def encode_batch(self, texts):
    return [e.ids for e in self.model.encode_batch(list(texts))]

  def decode(self, ids):
    return self.model.decode(list(ids), skip_special_tokens=False)


def _resolve_path(path: str) -> str:
  if os.path.isdir(path):
    for name in ('tokenizer.json', 'tokenizer.model'):
      if os.path.isfile(os.path.join(path, name)):
        return os.path.join(path, name)
  if os.path.isfile(path):
    return path
  raise DataError(
    f'no tokenizer at {path!r}: give a SentencePiece .model file, a Hugging Face '
    'tokenizer.json, or a directory holding one of them.'
  )


class Tokenizer:
  """Text <-> token ids, with the special ids the trainer and preprocessing need."""

  def __init__(
    self, path: str, *, eod_token=None, mask_token=None, pad_token=None, require_mask: bool = True
  ):
    self._args = dict(
      path=path,
      eod_token=eod_token,
      mask_token=mask_token,
      pad_token=pad_token,
      require_mask=require_mask,
    )
    self.path = _resolve_path(path)
    is_json = self.path.endswith('.json')
    self._backend = _HuggingFace(self.path) if is_json else _SentencePiece(self.path)
    self.vocab_size = self._backend.vocab_size
    self.eod_id = self._special('eod', eod_token, EOD_PIECES, self._backend.default_eod)
    self.mask_id = self._special('mask', mask_token, MASK_PIECES, None, required=require_mask)
    # Without a pad piece, pad with end-of-document: padded positions carry no loss anyway.
    self.pad_id = self._special('pad', pad_token, PAD_PIECES, self.eod_id)

  def _special(self, kind, override, candidates, default, required=True):
    flag = f'{kind}_token= (python -m dlmjax.preprocess: --{kind}-token)'
    if isinstance(override, int):
      if not 0 <= override < self.vocab_size:
        raise DataError(
          f'{kind} id {override} is outside the vocabulary of {self.path} ({self.vocab_size} ids)'
        )
      return override
    if override is not None:
      i = self._backend.piece_id(override)
      if i is None:
        raise DataError(
          f'{kind} token {override!r} is not a piece of {self.path}; pass a piece '
          f'it has, or its id, as {flag}'
        )
      return i
    for piece in candidates:
      i = self._backend.piece_id(piece)
      if i is not None:
        return i
    if default is not None or not required:
      return default
    raise DataError(
      f'no {kind} token found in {self.path} (looked for {", ".join(candidates)}); '
      f'pass the piece or id to use as {flag}.'
      + (
        ' A tokenizer without a mask piece needs one added (e.g. with '
        "tokenizers' add_special_tokens) before training a diffusion LM."
        if kind == 'mask'
        else ''
      )
    )

  def encode(self, text: str) -> list[int]:
    return list(self._backend.encode(text))

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Many texts at once, multithreaded inside the tokenizer library."""
    return [list(ids) for ids in self._backend.encode_batch(texts)]

  def decode(self, ids: Iterable[int]) -> str:
    return self._backend.decode([int(i) for i in ids])

  def piece_id(self, piece: str) -> int | None:
    return self._backend.piece_id(piece)

  def id_piece(self, i: int) -> str | None:
    """The piece of id i, or None past the vocabulary."""
    return self._backend.id_piece(int(i)) if 0 <= i < self.vocab_size else None

  def __getstate__(self):
    return self._args  # reload by path in worker processes.

  def __setstate__(self, state):
    self.__init__(**state)

  def __repr__(self):
    return (
      f'Tokenizer({self.path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id}, '
      f'mask_id={self.mask_id}, pad_id={self.pad_id})'
    )


def load_tokenizer(
  path: str, *, eod_token=None, mask_token=None, pad_token=None, require_mask: bool = True
) -> Tokenizer:
  """Loads a tokenizer; each *_token is a piece (str) or id (int) overriding the lookup."""
  return Tokenizer(
    path, eod_token=eod_token, mask_token=mask_token, pad_token=pad_token, require_mask=require_mask
  )


def vocab_size(path: str) -> int:
  """The number of ids a tokenizer (file or directory) can produce, special tokens included."""
  path = _resolve_path(path)
  return (_HuggingFace(path) if path.endswith('.json') else _SentencePiece(path)).vocab_size


# ----------------------------------------------------------------------------------------------
# Training


def read_jsonl_texts(path: str, key: str = 'text') -> Iterator[str]:
  """The string `key` of each JSON line of a .jsonl or .jsonl.gz file (others are skipped)."""
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rt', encoding='utf-8') as f:
    for line in f:
      try:
        text = json.loads(line).get(key)
      except (json.JSONDecodeError, AttributeError):
        continue
      if isinstance(text, str):
        yield text


def _bounded_chunks(texts: Iterable[str], max_chars: int, chunk_chars: int) -> Iterator[str]:
  """Texts cut at line ends into pieces SentencePiece accepts, until max_chars are given.

  SentencePiece skips sentences longer than max_sentence_length, and holds all input in memory:
  both bounds keep training fast and complete.
  """
  total = 0
  for text in texts:
    buf = []
    size = 0
    for line in text.splitlines(keepends=True):
      for start in range(0, len(line), chunk_chars):
        part = line[start : start + chunk_chars]
        if size + len(part) > chunk_chars and buf:
          yield ''.join(buf)
          buf, size = [], 0
        buf.append(part)
        size += len(part)
        total += len(part)
      if total >= max_chars:
        break
    if buf:
      yield ''.join(buf)
    if total >= max_chars:
      return


def train_sentencepiece(
  texts,
  model_prefix: str,
  vocab_size: int,
  *,
  model_type: str = 'bpe',
  json_key: str = 'text',
  max_chars: int = 4_000_000,
  seed: int = 0,
) -> str:
  """Trains a SentencePiece model on texts (an iterable of str, or a .jsonl[.gz] path).

  Special ids: pad 0 `<pad>`, unk 1 `<unk>`, eod 2 `<|endoftext|>`, mask 3 `<|mask|>`, then
  newline 4, then the 256 byte-fallback pieces. Whitespace and newlines are kept exactly, so
  decode(encode(text)) == text, which code needs. BPE: ~10x faster to train than unigram here
  and compresses as well. One thread: SentencePiece's result depends on the thread count, and
  the model must be the same on every machine. Only the first max_chars of input are used.

  Returns:
    The path of the written `<model_prefix>.model`.
  """
  import sentencepiece  # pylint: disable=import-outside-toplevel

  if isinstance(texts, (str, os.PathLike)):
    texts = read_jsonl_texts(str(texts), json_key)
  model = io.BytesIO()
  sentencepiece.set_random_generator_seed(seed)
  try:
    sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=_bounded_chunks(texts, max_chars, chunk_chars=2048),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=0,
      pad_piece='<pad>',
      unk_id=1,
      unk_piece='<unk>',
      bos_id=-1,
      eos_id=2,
      eos_piece='<|endoftext|>',
      user_defined_symbols=['<|mask|>', '\n'],
      byte_fallback=True,
      character_coverage=0.9995,
      split_digits=True,
      normalization_rule_name='identity',
      remove_extra_whitespaces=False,
      add_dummy_prefix=False,
      allow_whitespace_only_pieces=True,
      max_sentence_length=4 * 2048,
      input_sentence_size=0,
      shuffle_input_sentence=False,
      num_threads=1,
      minloglevel=2,
    )
  except RuntimeError as e:
    raise DataError(
      f'SentencePiece training for {model_prefix}.model failed: {e}. With too '
      'little text for the vocabulary, lower vocab_size or give more text.'
    ) from e
  path = f'{model_prefix}.model'
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'wb') as f:
    f.write(model.getvalue())
  os.replace(tmp, path)
  return path
