"""python -m benchmarks.sampler (--checkpoint-path P | --config configs/X.py) [options]

Generated tokens/s of the sampler, plain (LLaDA's schedule) against the fast modes: confidence-
threshold decoding, stop-at-EOS, and (causal / block-causal models) the truncated canvas. One JSON
line per mode. A trained checkpoint shows what the threshold buys; random weights (--config) are
rarely confident, so there only the plain figure means something. The 1.7B figure
(docs/benchmarks.md, Sampler):
  python -m benchmarks.sampler --config configs/pretrain_1p7b.py --batch 64 --gen-length 256 \
      --steps 256 --block-length 32 --prompt-length 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np

from dlmjax.diffusion import sampler_programs, sampling_config


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.sampler',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument('--checkpoint-path', help='run, step or Hugging Face directory')
  source.add_argument('--config', help='config file (random weights), e.g. configs/tiny.py')
  parser.add_argument('--dtype', default=None, help="fp32 | bf16 (default: the config's)")
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--prompt-length', type=int, default=32)
  parser.add_argument('--gen-length', type=int, default=64)
  parser.add_argument('--steps', type=int, default=64)
  parser.add_argument('--block-length', type=int, default=32)
  parser.add_argument('--threshold', type=float, default=0.9, help='Fast-dLLM uses 0.9')
  parser.add_argument('--modes', default='plain,threshold,threshold+eos,truncate')
  parser.add_argument('--repeats', type=int, default=3)
  return parser


def _load(args):
  # pylint: disable=import-outside-toplevel
  from dlmjax import config as config_lib
  from dlmjax import inference
  from dlmjax import model as model_lib

  if args.checkpoint_path:
    return inference.load_pretrained(args.checkpoint_path, dtype=args.dtype)
  config = config_lib.load_file(args.config)
  if args.dtype:
    config.model.dtype = {'fp32': 'float32', 'bf16': 'bfloat16'}.get(args.dtype, args.dtype)
  if config.model.attention_backend != 'xla' and jax.default_backend() != 'gpu':
    config.model.attention_backend = 'xla'
  model_config = model_lib.ModelConfig.from_config(config)
  params = jax.jit(model_lib.init_params, static_argnums=0)(model_config, jax.random.key(0))
  return inference.Pretrained(config, params, source=args.config)


def measure(
  model, sampling: sampling_config.SamplingConfig, prompt_BP, lengths_B, repeats: int
) -> dict:
  """Compile time and the best of `repeats` timed runs, as generated tokens per second."""
  m = model.config.model
  fn = sampler_programs.make_generate_fn(
    model.model_config,
    sampling,
    mask_id=m.mask_token_id,
    eos_id=m.eos_token_id,
    pad_id=m.pad_token_id,
    vocab_size=m.vocab_size,
  )
  start = time.perf_counter()
  jax.block_until_ready(fn(model.params, prompt_BP, lengths_B, jax.random.key(0)))
  compile_s = time.perf_counter() - start
  times = []
  for i in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(model.params, prompt_BP, lengths_B, jax.random.key(i + 1)))
    times.append(time.perf_counter() - start)
  best = min(times)
  generated = prompt_BP.shape[0] * sampling.gen_length
  return dict(
    tokens_per_s=round(generated / best, 1),
    seconds=round(best, 4),
    first_call_s=round(compile_s, 2),
    eos_rows=int(
      np.mean([(row == m.eos_token_id).any() for row in np.asarray(out)[:, prompt_BP.shape[1] :]])
      * 100
    ),
  )


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  plain = sampling_config.SamplingConfig(
    gen_length=args.gen_length, steps=args.steps, block_length=args.block_length
  )
  variants = {
    'plain': plain,
    'threshold': dataclasses.replace(plain, threshold=args.threshold),
    'threshold+eos': dataclasses.replace(plain, threshold=args.threshold, stop_at_eos=True),
    'truncate': dataclasses.replace(plain, cache='truncate'),
  }
  modes = [m.strip() for m in args.modes.split(',') if m.strip()]
  try:
    unknown = set(modes) - set(variants)
    if unknown:
      raise ValueError(f'unknown modes {sorted(unknown)}; known: {list(variants)}.')
    for mode in modes:
      variants[mode].validate()
    model = _load(args)
    if model.model_config.attention_mask == 'bidirectional' and 'truncate' in modes:
      modes.remove('truncate')  # inexact there, so refused (sampler.generate says why).
    m = model.config.model
    rng = np.random.default_rng(0)
    special = {m.mask_token_id, m.eos_token_id, m.pad_token_id}
    choices = np.array([t for t in range(min(m.vocab_size, 1000)) if t not in special])
    prompt_BP = rng.choice(choices, (args.batch, args.prompt_length)).astype(np.int32)
    lengths_B = np.full(args.batch, args.prompt_length, np.int32)
    base = None
    for mode in modes:
      row = dict(
        mode=mode,
        device=jax.devices()[0].device_kind,
        batch=args.batch,
        prompt=args.prompt_length,
        gen=args.gen_length,
        steps=args.steps,
        block=args.block_length,
        **measure(model, variants[mode], prompt_BP, lengths_B, args.repeats),
      )
      base = base or row['tokens_per_s']
      row['vs_plain'] = round(row['tokens_per_s'] / base, 2)
      print(json.dumps(row), flush=True)
  except ValueError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
