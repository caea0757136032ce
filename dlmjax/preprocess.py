"""Turn JSONL text into Megatron indexed datasets, or train a SentencePiece tokenizer on it.

    python -m dlmjax.preprocess --input data.jsonl[.gz] --output-prefix P --tokenizer T \\
        --json-keys text --append-eod --workers N
    python -m dlmjax.preprocess train-tokenizer --input data.jsonl --model-prefix P --vocab-size N

The first writes {P}_{key}_document.bin/.idx, readable by Megatron and by data.train_prefixes.
"""

from __future__ import annotations

import argparse
import os
import sys

from dlmjax.data import jsonl
from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError


def _special(value):
  """A --*-token value: an integer id, or a piece."""
  return int(value) if value is not None and value.lstrip('-').isdigit() else value


def _preprocess(argv):
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.preprocess',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--input', required=True, help='a .jsonl or .jsonl.gz file')
  parser.add_argument('--output-prefix', required=True)
  parser.add_argument(
    '--tokenizer',
    required=True,
    help='a SentencePiece .model, a tokenizer.json, or a directory with one',
  )
  parser.add_argument('--json-keys', nargs='+', default=['text'])
  parser.add_argument(
    '--append-eod',
    action='store_true',
    help='end every non-empty document with the end-of-document token',
  )
  parser.add_argument('--workers', type=int, default=1)
  parser.add_argument('--log-interval', type=float, default=10.0, help='seconds between logs')
  for kind in ('eod', 'mask', 'pad'):
    parser.add_argument(f'--{kind}-token', help=f'the {kind} piece or id, if not found by name')
  args = parser.parse_args(argv)
  tokenizer = tokenizer_lib.load_tokenizer(
    args.tokenizer,
    eod_token=_special(args.eod_token),
    mask_token=_special(args.mask_token),
    pad_token=_special(args.pad_token),
    require_mask=False,
  )
  report = jsonl.preprocess_jsonl(
    args.input,
    args.output_prefix,
    tokenizer,
    json_keys=args.json_keys,
    append_eod=args.append_eod,
    workers=args.workers,
    log_every_s=args.log_interval,
  )
  return 1 if report.num_bad_lines and not report.documents else 0


def _train_tokenizer(argv):
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.preprocess train-tokenizer',
    description=tokenizer_lib.train_sentencepiece.__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--input', required=True, help='a .jsonl or .jsonl.gz file')
  parser.add_argument('--model-prefix', required=True, help='writes <model-prefix>.model')
  parser.add_argument('--vocab-size', type=int, required=True)
  parser.add_argument('--json-key', default='text')
  parser.add_argument('--model-type', default='bpe', choices=['bpe', 'unigram'])
  parser.add_argument(
    '--max-chars',
    type=int,
    default=4_000_000,
    help='train on the first this many characters of the input',
  )
  args = parser.parse_args(argv)
  os.makedirs(os.path.dirname(os.path.abspath(args.model_prefix)), exist_ok=True)
  path = tokenizer_lib.train_sentencepiece(
    args.input,
    args.model_prefix,
    args.vocab_size,
    model_type=args.model_type,
    json_key=args.json_key,
    max_chars=args.max_chars,
  )
  print(f'wrote {path}: {tokenizer_lib.load_tokenizer(path)}')
  return 0


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv[:1] == ['train-tokenizer']:
    return _train_tokenizer(argv[1:])
  return _preprocess(argv)


if __name__ == '__main__':
  try:
    sys.exit(main())
  except DataError as e:  # bad input: one readable line, not a traceback (as dlmjax.cli does).
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
