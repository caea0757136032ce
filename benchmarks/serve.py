"""python -m benchmarks.serve (--checkpoint-path P | --config FILE [--preset NAME]) [options]

Load test of python -m dlmjax.serve's stack (the same engine and FastAPI app, on uvicorn in this
process): for each client count (--clients 1,4,16,64) that many clients send streamed requests
back to back, each --requests-per-client of them, until done or --time-limit. Prompts and
max_tokens are drawn from the --prompt-lengths and --gen-lengths mixes (a prompt's length is
uniform between the previous mix value and its own). Every program is compiled before timing.
One JSON line per client count: generated tok/s, time to first block and latency (p50 / p99),
the engine's busy fraction (the device's time in the sampler's calls over wall time: calls
are pipelined, each counted from the later of its launch and the previous call's end), the
host's time inside the calls over their device time (dispatch_blocking), the compilations in
the timed window and, at one client, the HTTP path's overhead over decode time (summed request
latencies over busy time, less one; each client keeps one connection and its gap between
requests is not counted). After each client count, its ceiling: the canvas its calls ran most,
one block call of the engine's warmed program timed directly (no HTTP, no scheduler) at batch 1
and at that count's batch (at most --max-batch), best of 3; ceiling_x = rows x t_1 / t_B is the
throughput multiple the device itself gives that many rows over one, which no scheduler can
beat. Then the goals: 16 clients >= 8x one client's tok/s (beside it the 16-row ceiling and the
share of it reached, throughput_vs_ceiling), p99 latency < 3x one client's, HTTP overhead < 5%.

The clients only ever connect to the server this process starts on 127.0.0.1. Random weights
(--config) have no tokenizer: prompts are token ids, texts are the ids written out; their
params are float32 (32 GB at the 8B shape), computed in --dtype. The GPU table
(docs/serving.md) comes from these, each sized to end within about 280 s on one H100 (an
estimate; compilation included: 14 and 12 programs, canvases 256 and 512):
  python -m benchmarks.serve --config configs/pretrain_1p7b.py --dtype bf16 --cache dual \
      --clients 1,4,16,64 --max-batch 64 --requests-per-client 2 --prompt-lengths 64,256 \
      --gen-lengths 128 --time-limit 30
  python -m benchmarks.serve --config configs/pretrain_1p7b.py --preset llada_8b --dtype bf16 \
      --cache dual --clients 1,4,16,64 --max-batch 32 --requests-per-client 2 \
      --prompt-lengths 64,256 --gen-lengths 128 --time-limit 30
At the 8B shape 32 rows' blocks (1,024 tokens, about 16 TFLOP a step) already outlast the read
of the weights, so more rows a call would add the dual cache's K/V (0.5 MiB a canvas position)
and compilations rather than throughput (an estimate); 64 clients then queue for the slots.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
import time

import httpx
import jax
import numpy as np

from dlmjax import cli
from dlmjax.data.errors import DataError
from dlmjax.diffusion import sampling_config

REPEATS = 3  # timed block calls per ceiling measurement, the best kept


class IdText:
  """A tokenizer stand-in for random weights: text is token ids written as 't<id>' words."""

  def encode(self, text: str) -> list:
    return [int(word[1:]) for word in text.split()]

  def encode_batch(self, texts) -> list:
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    return ' '.join(f't{i}' for i in ids)

  def piece_id(self, piece):
    del piece


def _sizes(text: str) -> list:
  return [int(s) for s in text.split(',') if s.strip()]


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.serve',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument('--checkpoint-path', help='run, step or Hugging Face directory')
  source.add_argument('--config', help='config file (random weights)')
  parser.add_argument(
    '--preset', default='', help="a model shape over --config's (random weights), e.g. llada_8b"
  )
  parser.add_argument(
    '--dtype', choices=('fp32', 'bf16'), default=None, help="compute dtype (default: the model's)"
  )
  parser.add_argument('--clients', type=_sizes, default=[1, 4, 16, 64])
  parser.add_argument('--requests-per-client', type=int, default=4)
  parser.add_argument('--time-limit', type=float, default=120.0, help='seconds per client count')
  parser.add_argument('--prompt-lengths', type=_sizes, default=[64, 256, 512])
  parser.add_argument('--gen-lengths', type=_sizes, default=[128, 256])
  parser.add_argument('--block-length', type=int, default=32)
  parser.add_argument('--tokens-per-step', type=int, default=1, help='steps = max_tokens / this')
  parser.add_argument(
    '--max-batch', type=int, default=0, help='rows a call (default: the most clients; 8B: above)'
  )
  parser.add_argument(
    '--cache',
    default='none',
    help="the requests' cache mode, one of the sampler's (dlmjax/diffusion/cache_modes/): none, "
    'prefix, dual (bidirectional); block, truncate (causal / block-causal)',
  )
  parser.add_argument('--threshold', type=float, default=0.0, help='Fast-dLLM parallel commits')
  parser.add_argument(
    '--system-prompt',
    type=int,
    default=0,
    help='tokens of one shared prefix every prompt starts with (prefix reuse: cache block)',
  )
  parser.add_argument('--prefix-cache', type=int, default=4, help='stored prefixes (0 = off)')
  parser.add_argument(
    '--blocks-per-call',
    type=int,
    default=4,
    help="blocks a lone group decodes a call (the server's flag; 1 = block by block)",
  )
  return parser


def random_config(args):
  """The config of the random-weight model (--config, then --preset's shape, --dtype; XLA's
  attention off a GPU), validated: what _load initialises, which a test builds abstractly."""
  # pylint: disable=import-outside-toplevel
  from dlmjax import config as config_lib

  config = config_lib.load_file(args.config)
  if args.preset:
    config_lib.apply_preset(config.model, args.preset)
  if args.dtype:
    config.model.dtype = {'fp32': 'float32', 'bf16': 'bfloat16'}[args.dtype]
  if config.model.attention_backend != 'xla' and jax.default_backend() != 'gpu':
    config.model.attention_backend = 'xla'
  elif config.model.attention_backend == 'cudnn' and config.model.attention_mask != 'bidirectional':
    config.model.attention_backend = 'auto'  # cuDNN has no block-causal mask (SDAR's presets)
  config_lib.validate(config)
  return config


def _load(args):
  # pylint: disable=import-outside-toplevel
  from dlmjax import inference
  from dlmjax import model as model_lib

  if args.checkpoint_path:
    model = inference.load_pretrained(args.checkpoint_path, dtype=args.dtype)
  else:
    config = random_config(args)
    model_config = model_lib.ModelConfig.from_config(config)
    # Stored in the compute dtype, as a served checkpoint's bf16 weights are: float32 ones
    # would hold the 8B twice over (32 GB beside the engine's bf16 copy; out of memory at 16
    # rows on an 80 GB card).
    params = jax.jit(
      lambda key: jax.tree.map(
        lambda a: a.astype(model_config.compute_dtype), model_lib.init_params(model_config, key)
      )
    )(jax.random.key(0))
    model = inference.Pretrained(config, params, source='')
  try:
    model.tokenizer  # pylint: disable=pointless-statement
  except DataError:
    model.__dict__['tokenizer'] = IdText()  # over the cached_property: no tokenizer here
  return model


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _percentile(values, q) -> float:
  return round(float(np.percentile(values, q)), 4) if values else float('nan')


def _request(client: httpx.Client, body: dict) -> dict:
  """One streamed completion: seconds to the first block and to the end, tokens generated."""
  start = time.perf_counter()
  first, tokens = None, 0
  with client.stream('POST', '/v1/completions', json=body, timeout=600) as response:
    if response.status_code != 200:
      response.read()
      raise RuntimeError(f'HTTP {response.status_code}: {response.text[:200]}')
    for line in response.iter_lines():
      if not line.startswith('data: {'):
        continue
      event = json.loads(line[6:])
      if first is None and event['choices'] and event['choices'][0]['text']:
        first = time.perf_counter() - start
      if event.get('usage'):
        tokens = event['usage']['completion_tokens']
  return {'first_s': first, 'latency_s': time.perf_counter() - start, 'tokens': tokens}


@contextlib.contextmanager
def _compilations():
  """The list of every XLA compilation's seconds inside the block, the engine's or any jit's."""
  compiles = []

  def compiled(event, seconds, **_):
    if event == '/jax/core/compile/backend_compile_duration':
      compiles.append(seconds)

  jax.monitoring.register_event_duration_secs_listener(compiled)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(compiled)


def run_level(url, eng, clients, bodies, time_limit) -> dict:
  """`clients` threads sending their bodies in turn; the measured row."""
  results, errors, deadline = [], [], time.perf_counter() + time_limit
  busy0, calls0, rows0, slots0 = eng.busy_s, eng.calls, eng.rows, eng.slots
  reused0, blocks0, dispatch0, held0 = eng.prefix_rows, eng.blocks, eng.dispatch_s, eng.held_s

  def client(mine):
    # One connection a client, as a real client keeps: a new httpx.Client per request builds
    # an SSL context (about 20 ms on the CPU) that the server's overhead figure would count.
    with httpx.Client(base_url=url) as connection:
      for body in mine:
        if time.perf_counter() > deadline:
          return
        try:
          results.append(_request(connection, body))
        except (RuntimeError, httpx.HTTPError) as e:
          errors.append(str(e))

  with _compilations() as compiles:
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(bodies[i::clients],)) for i in range(clients)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    wall = time.perf_counter() - start
  busy = eng.busy_s - busy0
  latencies = [r['latency_s'] for r in results]
  firsts = [r['first_s'] for r in results if r['first_s'] is not None]
  return {
    'clients': clients,
    'requests': len(results),
    'errors': len(errors),
    'generated_tok_s': round(sum(r['tokens'] for r in results) / wall, 1),
    'first_block_p50_s': _percentile(firsts, 50),
    'latency_p50_s': _percentile(latencies, 50),
    'latency_p99_s': _percentile(latencies, 99),
    'busy_fraction': round(busy / wall, 3),
    # The host's time inside the sampler's calls over their device time: near 0 where dispatch
    # is asynchronous, near 1 where it waits for the device (engine.py, the dispatch thread).
    'dispatch_blocking': round((eng.dispatch_s - dispatch0) / busy, 3) if busy else None,
    # Compilations inside the timed window (0: warm-up compiled everything the traffic ran).
    'compiled_while_timed': len(compiles),
    'calls': eng.calls - calls0,
    # Requests' rows a call (the batching achieved) and the share of its slots that were padding.
    'rows_per_call': round((eng.rows - rows0) / max(eng.calls - calls0, 1), 2),
    'padding': round(1 - (eng.rows - rows0) / max(eng.slots - slots0, 1), 3),
    # Blocks a call decoded (a lone group decodes up to --blocks-per-call in one call).
    'blocks_per_call': round((eng.blocks - blocks0) / max(eng.calls - calls0, 1), 2),
    'prefix_rows': eng.prefix_rows - reused0,  # rows prefilled after a stored system prompt
    # The scheduler's time holding a dispatch for the next requests of clients whose jobs ended.
    'held_s': round(eng.held_s - held0, 3),
    # Time outside the sampler's calls per unit of decode: meaningful with one client.
    'http_overhead': round((sum(latencies) - busy) / busy, 4) if busy and clients == 1 else None,
    'first_error': errors[0] if errors else None,
  }


def ceiling(eng, canvases, clients, prompt, memo) -> dict:
  """What the device allows at this level, with no scheduler or HTTP: the canvas its calls ran
  most (`canvases`: calls per (block settings, length)), one block call timed at batch 1 and at
  the batch bucket of min(clients, max_batch) rows, best of REPEATS; ceiling_x = rows x t_1 / t_B
  is the throughput multiple those rows can give over one. memo keeps t_1 per canvas."""
  (settings, length), _ = canvases.most_common(1)[0]
  rows = min(clients, eng.max_batch)
  batch = eng.buckets.pick(eng.buckets.batch, rows, eng.max_batch)
  with _compilations() as compiles:
    if (settings, length) not in memo:
      memo[settings, length] = eng.time_block(settings, 1, length, prompt, REPEATS)
    one = memo[settings, length]
    many = one if batch == 1 else eng.time_block(settings, batch, length, prompt, REPEATS)
  return {
    'ceiling_x': round(rows * one / many, 2),
    'ceiling_canvas': f'batch {batch} x length {length}',
    'block_call_1_s': round(one, 5),
    'block_call_s': round(many, 5),
    # Compilations in the ceiling's calls (0: they ran the programs warm-up compiled).
    'ceiling_compiled': len(compiles),
  }


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  # pylint: disable=import-outside-toplevel
  import uvicorn

  from dlmjax.serve import api
  from dlmjax.serve import engine as engine_lib

  try:
    if min(args.clients + args.prompt_lengths + args.gen_lengths) < 1:
      raise ValueError('--clients, --prompt-lengths and --gen-lengths must be positive.')
    if args.preset and args.checkpoint_path:
      raise ValueError(
        '--preset shapes random weights (--config); a checkpoint has its own shape: drop one.'
      )
    gen = max(args.gen_lengths)
    defaults = sampling_config.SamplingConfig(
      gen_length=gen,
      steps=gen // args.tokens_per_step,
      block_length=min(args.block_length, gen),
      cache=args.cache,
      threshold=args.threshold,
    ).validate()
    model = _load(args)
    max_batch = args.max_batch or max(args.clients)
    # Powers of two up to max_batch: a call of n rows pads to < 2n, not to the most clients.
    batches = tuple(sorted({2**i for i in range(max_batch.bit_length())} | {max_batch}))
    # Canvas lengths: powers of two from 64 to the longest prefix + the longest tail a group
    # of mixed requests can need (a row's current block sits where its batch-mates' do).
    need = args.system_prompt + max(args.prompt_lengths) + 2 * max(args.gen_lengths)
    widths = tuple(2**i for i in range(6, max(7, (need - 1).bit_length() + 1)))
    eng, app = api.build(
      model,
      defaults,
      model_name='bench',
      max_batch=max_batch,
      max_queue=max(args.clients) * 2,
      buckets=engine_lib.Buckets(batch=batches, width=widths),
      prefix_cache=args.prefix_cache,
      blocks_per_call=args.blocks_per_call,
    )
    rules = api.Server(eng, defaults=defaults, model_name='bench', chat_template='none')
    requests = [rules.settings({'max_tokens': g}) for g in args.gen_lengths]  # as served
    for settings in requests:
      eng.check(engine_lib.Job([0] * (args.system_prompt + max(args.prompt_lengths)), settings))
  except (ValueError, api.APIError) + cli.user_errors() as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  m = model.config.model
  rng = np.random.default_rng(0)
  special = {m.mask_token_id, m.eos_token_id, m.pad_token_id}
  choices = np.array([t for t in range(min(m.vocab_size, 5000)) if t not in special])
  system = rng.choice(choices, args.system_prompt).tolist()
  start, warmed = time.perf_counter(), set()
  for tail in choices[:2]:  # the shared system prompt stored, as two requests would store it
    eng.prefixes.remember(engine_lib.Job(system + [int(tail)], requests[0]))
  # Every program the traffic can run, before timing: requests differing only in max_tokens
  # share their programs, warmed for the shortest row (canvas lengths no row needs are skipped);
  # with a stored system prompt every row starts with it, so only its programs are warmed.
  for settings in sorted(requests, key=lambda s: s.gen_length):
    block = eng.block_settings(settings)
    if block not in warmed:
      warmed.add(block)
      eng.warmup.run(settings, widths, args.system_prompt + 1, prefixed=args.system_prompt > 0)
  print(
    json.dumps({'compiled': len(eng.compiled), 'compile_s': round(time.perf_counter() - start, 1)}),
    flush=True,
  )
  port = _free_port()
  url = f'http://127.0.0.1:{port}'
  server = api.DrainingServer(
    uvicorn.Config(app, host='127.0.0.1', port=port, log_config=None), eng
  )
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.05)
  mixes = tuple(sorted(set(args.prompt_lengths)))
  bounds = [0, *mixes]
  rows, memo = [], {}
  for clients in args.clients:
    bodies = []
    for _ in range(clients * args.requests_per_client):
      i = rng.integers(len(mixes))
      length = int(rng.integers(bounds[i] + 1, bounds[i + 1] + 1))
      bodies.append({
        'prompt': system + rng.choice(choices, length).tolist(),
        'max_tokens': int(rng.choice(args.gen_lengths)),
        'stream': True,
      })  # fmt: skip
    canvases = eng.canvases.copy()
    row = run_level(url, eng, clients, bodies, args.time_limit)
    if row['calls']:  # the server is idle between levels: the device is the ceiling's alone
      prompt = system + [int(choices[0])]  # starts with the stored system prompt, as traffic
      row.update(ceiling(eng, eng.canvases - canvases, clients, prompt, memo))
    row['device'] = jax.devices()[0].device_kind
    rows.append(row)
    print(json.dumps(row), flush=True)
  server.should_exit = True
  thread.join(timeout=60)
  eng.drain(timeout=60)
  by = {r['clients']: r for r in rows}
  if 1 in by and 16 in by and by[1]['generated_tok_s']:
    goals = {
      'throughput_16_over_1': round(by[16]['generated_tok_s'] / by[1]['generated_tok_s'], 2),
      'p99_16_over_1': round(by[16]['latency_p99_s'] / by[1]['latency_p99_s'], 2),
      'http_overhead_1': by[1]['http_overhead'],
    }
    if 'ceiling_x' in by[16]:  # the device's own multiple at 16 rows, and the share reached
      goals['ceiling_16'] = by[16]['ceiling_x']
      goals['throughput_vs_ceiling'] = round(goals['throughput_16_over_1'] / goals['ceiling_16'], 2)
    goals['met'] = (
      goals['throughput_16_over_1'] >= 8
      and goals['p99_16_over_1'] < 3
      and (goals['http_overhead_1'] or 0) < 0.05
    )
    print(json.dumps({'goals': goals}), flush=True)
  return 0 if all(not r['errors'] for r in rows) else 1


if __name__ == '__main__':
  sys.exit(main())
