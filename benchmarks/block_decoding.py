"""python -m benchmarks.block_decoding [--tiny] [options]

Generated tokens/s of block decoding (a block-causal model, the exact block K/V cache, blocks of
32 and SDAR's 4) against bidirectional decoding of the same shape without a cache (`none`) and
with Fast-dLLM's dual cache (`dual`): the same random weights under each attention mask, the same
prompts, the same tokens per step. The block variants run stop_at_eos (the any-length loop) with
an EOS id no token has, so every variant decodes gen_length tokens per row: the figures are the
full-length cost (a trained model that stops early costs only the blocks its longest text needs;
the `blocks` column counts the blocks run). Before timing: a
block-cached step's logits against the whole forward of the block-causal model (relative max
|dlogit|), and the sampler's tokens with the block cache against those without, on a small batch.
One JSON line per measurement, one table last. On one H200 (about 3 minutes):
  python -m benchmarks.block_decoding
(defaults: the 1.7B of configs/pretrain_1p7b.py, batch 64, 64-token prompts, gen 256 and 512,
two tokens per step). On a CPU: python -m benchmarks.block_decoding --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import sampler_cache
from dlmjax import model as model_lib
from dlmjax.diffusion import sampler, sampling_config

NO_EOS = -1  # an EOS id no token has: every row decodes gen_length tokens, as in the other modes.
# (attention mask, cache mode, block length or None for --block-length): the variants timed.
VARIANTS = {
  'none': ('bidirectional', 'none', None),
  'dual': ('bidirectional', 'dual', None),
  'block': ('block_causal', 'block', None),
  'block4': ('block_causal', 'block', 4),
}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.block_decoding',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--config', default='configs/pretrain_1p7b.py', help='model shape')
  parser.add_argument('--tiny', action='store_true', help='a CPU-sized model and run')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--prompt-length', type=int, default=64)
  parser.add_argument('--gen-lengths', default='256,512')
  parser.add_argument('--block-length', type=int, default=32, help='none, dual and block')
  parser.add_argument(
    '--tokens-per-step', type=int, default=2, help='steps = gen / this, for every variant'
  )
  parser.add_argument('--threshold', type=float, default=0.0, help='0 = off (every variant)')
  parser.add_argument('--variants', default=','.join(VARIANTS), help=', '.join(VARIANTS))
  parser.add_argument('--repeats', type=int, default=1, help='timed calls after compiling')
  return parser


def _settings(args, gen, variant):
  kind, mode, block = VARIANTS[variant]
  block = block or args.block_length
  return kind, sampling_config.SamplingConfig(
    gen_length=gen,
    steps=gen // args.tokens_per_step,
    block_length=block,
    threshold=args.threshold,
    cache=mode,
    stop_at_eos=mode == 'block',  # the any-length loop (NO_EOS: nothing stops)
  ).validate()


def _decode_fn(model_config, sampling, m):
  """jit(params, prompt, lengths, key) -> (tokens, blocks decoded, commit steps): the sampler
  itself, EOS off."""

  def fn(params, prompt_BP, lengths_B, key):
    return sampler.decode_blocks(
      model_lib.merge(model_config, params),
      prompt_BP,
      lengths_B,
      sampling,
      key,
      mask_id=m.mask_token_id,
      eos_id=NO_EOS,
      pad_id=m.pad_token_id,
      vocab_size=m.vocab_size,
    )

  return jax.jit(fn)


def time_variant(model_config, params, sampling, prompt_BP, m, repeats) -> dict:
  lengths_B = np.full(prompt_BP.shape[0], prompt_BP.shape[1], np.int32)
  args = (params, prompt_BP, lengths_B, jax.random.key(0))
  start = time.perf_counter()
  compiled = _decode_fn(model_config, sampling, m).lower(*args).compile()
  compile_s = time.perf_counter() - start
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    out, ran, _ = jax.block_until_ready(compiled(*args))
    best = min(best, time.perf_counter() - start)
  tokens = prompt_BP.shape[0] * sampling.gen_length
  return dict(tokens_per_s=tokens / best, seconds=best, compile_s=compile_s, blocks=int(ran))


def check_tokens(model_config, params, prompt_BP, args, m) -> float:
  """Share of tokens the block cache decodes as `none` does (a few rows, two blocks, prompts of
  several lengths so that rows' first blocks open with their prompt's rest)."""
  rows = prompt_BP[: min(4, len(prompt_BP))]
  lengths = np.maximum(rows.shape[1] - np.arange(len(rows)) * 3, 1).astype(np.int32)
  live = np.arange(rows.shape[1])[None] >= rows.shape[1] - lengths[:, None]
  rows = np.where(live, rows, m.pad_token_id).astype(np.int32)
  s = sampling_config.SamplingConfig(
    gen_length=2 * args.block_length,
    steps=2 * args.block_length // args.tokens_per_step,
    block_length=args.block_length,
    cache='block',
  )
  key = jax.random.key(0)
  got = _decode_fn(model_config, s, m)(params, rows, lengths, key)[0]
  want = _decode_fn(model_config, dataclasses.replace(s, cache='none'), m)(
    params, rows, lengths, key
  )[0]
  return float(np.mean(np.asarray(got) == np.asarray(want)))


def _table(rows) -> str:
  head = ('gen', 'variant', 'attention', 'cache', 'block', 'steps', 'tok/s', 'x none', 'blocks')
  lines = [' | '.join(head), ' | '.join('---' for _ in head)]
  for r in rows:
    values = (r['gen'], r['variant'], r['attention'], r['cache'], r['block'], r['steps'])
    values += (r['tokens_per_s'], r.get('vs_none', '-'), r['blocks'])
    lines.append(' | '.join(str(v) for v in values))
  return '\n'.join(lines)


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.tiny:
    args.batch, args.prompt_length = min(args.batch, 4), min(args.prompt_length, 8)
    args.gen_lengths, args.block_length = '32', 8
  try:
    variants = [v.strip() for v in args.variants.split(',') if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
      raise ValueError(f'unknown variants {sorted(unknown)}; known: {list(VARIANTS)}.')
    gens = [int(g) for g in args.gen_lengths.split(',')]
    for gen in gens:
      for variant in variants:
        _settings(args, gen, variant)
    config, bidirectional = sampler_cache._model_config(args)  # pylint: disable=protected-access
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  m = config.model
  block_causal = {
    size: dataclasses.replace(bidirectional, attention_mask='block_causal', block_size=size)
    for size in {VARIANTS[v][2] or args.block_length for v in variants if v.startswith('block')}
  }
  params = jax.jit(model_lib.init_params, static_argnums=0)(bidirectional, jax.random.key(0))
  rng = np.random.default_rng(0)
  special = {m.mask_token_id, m.eos_token_id, m.pad_token_id}
  choices = np.array([t for t in range(min(m.vocab_size, 1000)) if t not in special])
  prompt_BP = rng.choice(choices, (args.batch, args.prompt_length)).astype(np.int32)
  device = jax.devices()[0].device_kind
  checks = {}
  for size, model_config in block_causal.items():
    checks[f'block_{size}_dlogit'] = sampler_cache.check_jax(
      model_config, params, prompt_BP, gens[0], size
    )
  checks['block_same_tokens_as_none'] = check_tokens(
    block_causal.get(args.block_length, next(iter(block_causal.values()), bidirectional)),
    params,
    prompt_BP,
    args,
    m,
  )
  print(json.dumps(dict(check='block cache vs no cache (block-causal model)', **checks)))
  bf16 = bidirectional.compute_dtype == jnp.bfloat16
  worst = max((v for k, v in checks.items() if k.endswith('dlogit')), default=0.0)
  # bf16 on GPU: the slice runs XLA attention, the whole canvas the flash kernel.
  if worst > (0.1 if bf16 else 1e-4) or (not bf16 and checks['block_same_tokens_as_none'] < 1):
    print(f'error: the block cache differs from the whole forward: {checks}', file=sys.stderr)
    return 1
  rows = []
  for gen in gens:
    base = None
    for variant in variants:
      kind, s = _settings(args, gen, variant)
      model_config = bidirectional if kind == 'bidirectional' else block_causal[s.block_length]
      got = time_variant(model_config, params, s, prompt_BP, m, args.repeats)
      row = dict(gen=gen, variant=variant, attention=kind, cache=s.cache, block=s.block_length)
      row.update(steps=s.steps, batch=args.batch, prompt=args.prompt_length, device=device)
      row.update(tokens_per_s=round(got['tokens_per_s'], 1), seconds=round(got['seconds'], 2))
      row.update(compile_s=round(got['compile_s'], 1), blocks=got['blocks'])
      if variant == 'none':
        base = got
      if base:
        row['vs_none'] = round(got['tokens_per_s'] / base['tokens_per_s'], 2)
      print(json.dumps(row), flush=True)
      rows.append(row)
  print(_table(rows))
  return 0


if __name__ == '__main__':
  sys.exit(main())
