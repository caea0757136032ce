"""python -m dlmjax.generate --checkpoint-path P (--prompt TEXT | --prompts-file in.jsonl) [...]

Samples completions from a checkpoint with the masked-diffusion sampler (dlmjax/diffusion/
sampler.py). P is a run directory (its latest step), a step directory or a Hugging Face directory.
A fine-tuned checkpoint's prompts are wrapped in its chat template. --prompt prints the
completion; --prompts-file reads jsonl rows {"prompt": ...} and writes each row with its
"completion" to --output (default: stdout). Same code as `load_pretrained(P).generate(...)`.
--infill TEMPLATE fills the template's <mask:N> holes anywhere in the text (fill-in-the-middle,
dlmjax/diffusion/infill.py) and prints the whole filled text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from dlmjax import cli
from dlmjax import inference
from dlmjax.data import jsonl
from dlmjax.data.errors import DataError
from dlmjax.diffusion import infill as infill_lib
from dlmjax.diffusion import sampling_config


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.generate',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--checkpoint-path', required=True, help=inference.MODEL_PATH_HELP)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument('--prompt', action='append', help='a prompt (repeat for several)')
  source.add_argument('--prompts-file', help='jsonl rows with a "prompt" string')
  source.add_argument(
    '--infill',
    action='append',
    help='a template with <mask:N> holes to fill (repeat for several; raw text; --steps steps)',
  )
  parser.add_argument('--output', default='', help='jsonl out (with --prompts-file)')
  sampling_config.add_arguments(parser)
  parser.add_argument(
    '--chat-template', default=None, help="override the checkpoint's template ('none' = raw prompt)"
  )
  parser.add_argument('--batch-size', type=int, default=8)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--dtype', default=None, help="fp32 | bf16 (default: the run's)")
  return parser


def _read_prompts(path: str) -> list[dict]:
  rows = []
  for number, row in jsonl.read_objects(path):
    if not isinstance(row.get('prompt'), str):
      raise DataError(
        f'{path}:{number} has no "prompt" string; rows look like {{"prompt": "..."}}.'
      )
    rows.append(row)
  return rows


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    sampling = sampling_config.from_arguments(args)  # validated before the (slow) checkpoint load
    rows = (
      _read_prompts(args.prompts_file)
      if args.prompts_file
      else [{'prompt': p} for p in args.prompt or args.infill]
    )
    if args.infill:
      infill_lib.check_settings(sampling)
    model = inference.load_pretrained(args.checkpoint_path, dtype=args.dtype)
    start = time.perf_counter()
    run = model.infill if args.infill else model.generate
    options = {} if args.infill else {'chat_template': args.chat_template}
    texts = run(
      [r['prompt'] for r in rows],
      seed=args.seed,
      batch_size=args.batch_size,
      **options,
      **dataclasses.asdict(sampling),
    )
    elapsed = time.perf_counter() - start
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if args.prompts_file:
    try:
      if args.output:  # into a directory that does not exist yet: made, as the user meant
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
      out = open(args.output, 'w') if args.output else sys.stdout  # pylint: disable=consider-using-with
    except OSError as e:
      print(
        f'error: cannot write --output {args.output!r} ({e.strerror}); give a file path.',
        file=sys.stderr,
      )
      return 2
    for row, text in zip(rows, texts):
      out.write(json.dumps({**row, 'completion': text}) + '\n')
    if args.output:
      out.close()
  else:
    for text in texts:
      print(text)
  what = 'templates' if args.infill else f'prompts x {sampling.gen_length} tokens'
  print(f'{len(rows)} {what} in {elapsed:.1f} s (with compilation)', file=sys.stderr)
  return 0


if __name__ == '__main__':
  sys.exit(main())
