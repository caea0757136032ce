"""python -m dlmjax.serve --checkpoint-path RUN_OR_HF_DIR [--host 127.0.0.1] [--port 8000] [...]

An OpenAI-compatible HTTP server (FastAPI on uvicorn) over the masked-diffusion sampler: GET
/v1/models, POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template),
GET /health. It loads any checkpoint `python -m dlmjax.generate` loads; the sampler flags are the
defaults of requests, which may set each one as an extra body field. Concurrent requests are
batched at block boundaries into fixed (batch, canvas length) buckets (dlmjax/serve/engine.py
and layout.py; docs/serving.md). SIGTERM stops taking requests, finishes the ones in flight, and
exits 0.
"""

from __future__ import annotations

import argparse
import logging
import sys

from dlmjax import cli
from dlmjax import inference
from dlmjax.diffusion import sampling_config
from dlmjax.serve import engine as engine_lib

log = logging.getLogger('dlmjax.serve')


def _sizes(text: str) -> tuple:
  try:
    sizes = tuple(sorted({int(s) for s in text.split(',') if s.strip()}))
  except ValueError:
    sizes = ()
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(f'{text!r} is not a list of positive sizes like 1,4,16.')
  return sizes


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m dlmjax.serve',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--checkpoint-path', required=True, help=inference.MODEL_PATH_HELP)
  parser.add_argument('--host', default='127.0.0.1')
  parser.add_argument('--port', type=int, default=8000)
  parser.add_argument('--served-model-name', default='', help='default: the checkpoint dir name')
  parser.add_argument('--max-batch', type=int, default=16, help='rows decoding at once')
  parser.add_argument('--max-queue', type=int, default=256, help='waiting jobs before 503')
  parser.add_argument(
    '--batch-buckets',
    type=_sizes,
    default=(1, 2, 4, 8, 16, 32, 64),
    help='batch shapes (<= max-batch; a call of n rows pads to the next one)',
  )
  parser.add_argument(
    '--width-buckets',
    type=_sizes,
    default=(64, 128, 256, 512, 1024, 2048, 4096),
    help='canvas-length shapes: prefix + the blocks a row still sees (a longer need runs as is)',
  )
  parser.add_argument(
    '--prefix-cache',
    type=int,
    default=4,
    help='shared prompt prefixes kept on the device (cache block, causal / block-causal; 0 = off)',
  )
  parser.add_argument(
    '--blocks-per-call',
    type=int,
    default=4,
    help='blocks a lone group decodes in one device call when nothing waits (1 = block by '
    'block; more: less host time per block, later joins: docs/serving.md)',
  )
  parser.add_argument('--no-warmup', action='store_true', help='compile on first use only')
  parser.add_argument('--drain-timeout', type=float, default=120.0, help='SIGTERM: seconds')
  sampling_config.add_arguments(parser)
  parser.add_argument(
    '--chat-template', default=None, help="override the checkpoint's template ('none' = raw)"
  )
  parser.add_argument('--dtype', default=None, help="fp32 | bf16 (default: the run's)")
  return parser


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  logging.basicConfig(format='%(asctime)s %(name)s: %(message)s', level=logging.WARNING)
  try:
    import uvicorn  # pylint: disable=import-outside-toplevel

    from dlmjax.serve import api  # pylint: disable=import-outside-toplevel
  except ImportError:
    cli.fail("the server needs its extra: pip install -e '.[serve]'")
  name = args.served_model_name or args.checkpoint_path.rstrip('/').split('/')[-1]
  try:
    defaults = sampling_config.from_arguments(args)
    if min(args.max_batch, args.blocks_per_call) < 1 or min(args.max_queue, args.prefix_cache) < 0:
      raise ValueError(
        '--max-batch and --blocks-per-call must be >= 1, --max-queue and --prefix-cache >= 0.'
      )
    model = inference.load_pretrained(args.checkpoint_path, dtype=args.dtype)
    eng, app = api.build(
      model,
      defaults,
      model_name=name,
      chat_template=args.chat_template,
      max_batch=args.max_batch,
      max_queue=args.max_queue,
      buckets=engine_lib.Buckets(batch=args.batch_buckets, width=args.width_buckets),
      prefix_cache=args.prefix_cache,
      blocks_per_call=args.blocks_per_call,
    )
  except (ValueError, OSError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  config = uvicorn.Config(
    app,
    host=args.host,
    port=args.port,
    log_level='warning',
    timeout_graceful_shutdown=args.drain_timeout,
  )
  log.warning(
    'serving %s as %r on http://%s:%d (batch buckets %s, width buckets %s, up to %d blocks a '
    'call)',
    args.checkpoint_path, name, args.host, args.port, eng.buckets.batch, eng.buckets.width,
    args.blocks_per_call,
  )  # fmt: skip
  api.DrainingServer(config, eng, warmup=None if args.no_warmup else defaults).run()
  drained = eng.drain(timeout=args.drain_timeout)
  log.warning('stopped (%s)', 'drained' if drained else 'drain timed out')
  return 0 if drained else 1


if __name__ == '__main__':
  sys.exit(main())
