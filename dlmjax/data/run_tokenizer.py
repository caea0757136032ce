"""The tokenizer of a run: data.tokenizer, else the built-in corpus's (what the model then learnt).

Every reader of a run's text goes through here: SFT and RL rows, generation, evaluation, and the
export that copies the tokenizer beside the weights.
"""

from __future__ import annotations

import os

from dlmjax.data import builtin
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError


def find(config, *, build: bool = False, beside: str | None = None) -> str | None:
  """The path of the run's tokenizer, or None where there is none here.

  build=False reads a finished run, maybe on another machine: a tokenizer file in the directory
  `beside` (a checkpoint or Hugging Face directory: an export ships its tokenizer there), else
  data.tokenizer when it exists here, else the built-in corpus's when data.source=builtin and it
  is built. build=True starts a run: data.tokenizer as given (loading names a missing one), else
  the built-in corpus's, built on first use.
  """
  for name in ('tokenizer.json', 'tokenizer.model') if beside and not build else ():
    if os.path.isfile(os.path.join(beside, name)):
      return os.path.join(beside, name)
  path = config.data.tokenizer
  if build:
    return (
      path
      or builtin.ensure_builtin_corpus(
        config.data.cache_dir or None, vocab_size=config.model.vocab_size
      ).tokenizer_path
    )
  if path and os.path.exists(path):
    return path
  if config.data.source == 'builtin':
    corpus = builtin.cached_corpus(config.data.cache_dir or None, config.model.vocab_size)
    return corpus.tokenizer_path if corpus else None
  return None


def load(config, *, build: bool = False, beside: str | None = None) -> tokenizer_lib.Tokenizer:
  """The run's tokenizer (find) with the model's end-of-document and padding ids, refused when it
  has more ids than the model has rows. The mask id stays the model's concern (it may be an
  embedding row past the tokenizer's ids)."""
  path = find(config, build=build, beside=beside)
  if path is None:
    raise DataError(
      'no tokenizer found for this run: its config names none (data.tokenizer) and '
      'the built-in corpus is not built; set data.tokenizer, or pass token ids '
      'instead of text.'
    )
  m = config.model
  tokenizer = tokenizer_lib.load_tokenizer(
    path, eod_token=m.eos_token_id, pad_token=m.pad_token_id, require_mask=False
  )
  if tokenizer.vocab_size > config.model.vocab_size:
    raise DataError(
      f'the tokenizer {path} has {tokenizer.vocab_size} ids but model.vocab_size '
      f'is {config.model.vocab_size}: use the tokenizer the model was trained with '
      '(data.tokenizer).'
    )
  return tokenizer
