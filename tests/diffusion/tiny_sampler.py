"""The sampler tests' tiny model and prompts: one definition for the sampler, cache, block
decoding and step-prediction tests."""

import contextlib
import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import model as model_lib
from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config
from dlmjax.model import programs
from tests.conftest import LEGACY_CPU_EMITTER, tiny_test_config

MASK, EOS, PAD, VOCAB = 3, 2, 0, 100
PROMPTS = [
  [5, 6, 7],
  [8, 9, 10, 11, 12, 13, 14],
  [20],
  [30, 31, 32, 33, 34],
  [40, 41],
  [50, 51, 52, 53, 54, 55, 56, 57],
  [60, 61, 62, 63],
  [70, 71, 72],
]


@contextlib.contextmanager
def default_cpu_emitters():
  """Sampler programs built inside compile with XLA:CPU's default fusion emitters, not the suite's
  faster legacy one (tests/conftest.py FAST_COMPILE). A sampled decode (temperature > 0) gives
  the same tokens with and without a cache only while both programs' logits agree bit for bit,
  as the default emitters compute them; the legacy one rounds the cached slice and the whole
  canvas apart in the last bit, enough to flip a near-tied draw."""
  compiler_options = programs.compiler_options
  legacy = LEGACY_CPU_EMITTER and jax.default_backend() == 'cpu'
  default = {'xla_cpu_use_fusion_emitters': True} if legacy else {}
  builders = (
    sampler_programs.make_generate_fn,
    sampler_programs.make_block_fn,
    sampler_programs.make_prefix_fn,
  )

  def options(matmul_dtype, *, decode=False):
    return {**compiler_options(matmul_dtype, decode=decode), **default}

  for built in builders:  # their programs were jitted with the suite's options
    built.cache_clear()
  try:
    with mock.patch.object(programs, 'compiler_options', options):
      yield
  finally:
    for built in builders:
      built.cache_clear()


# 2 blocks of 8, 3 steps per block: 3, 3, 2 tokens per step (the remainder goes first).
BASE = sampling_config.SamplingConfig(gen_length=16, steps=6, block_length=8)


def model(**overrides):
  # init_std 0.3: peaked predictions (median top probability 0.5), so confidences rarely tie.
  config = tiny_test_config(**{'model.vocab_size': VOCAB, 'model.init_std': 0.3, **overrides})
  model_config = model_lib.ModelConfig.from_config(config)
  return model_config, model_lib.init_params(model_config, jax.random.key(0))


@functools.lru_cache
def generate_fn(model_config, sampling, mesh=None, eos_id=EOS, fuse=True):
  """The fast path (fuse: q / k / v and gate / up fused, as every decode runs) or, fuse=False,
  the trained layout's three and two matmuls: the plain loop exact modes are held to."""
  return sampler_programs.make_generate_fn(
    model_config,
    sampling,
    mask_id=MASK,
    eos_id=eos_id,
    pad_id=PAD,
    vocab_size=VOCAB,
    mesh=mesh,
    fuse_projections=fuse,
  )


def generate(model_config, params, sampling, key=0, prompts=PROMPTS, mesh=None, fuse=True):
  prompt_BP, lengths_B = prompt_rows.pad_prompts(prompts, PAD)
  fn = generate_fn(model_config, sampling, mesh, fuse=fuse)
  return np.asarray(fn(params, prompt_BP, lengths_B, jax.random.key(key)))


# 2 blocks of 8, 4 steps per block: the cached steps are 3 of every 4.
CACHE_BASE = sampling_config.SamplingConfig(gen_length=16, steps=8, block_length=8)


def canvas(prompts, gen_length, seed=0):
  """A left-padded canvas of prompts and random completion tokens, its segment ids and positions."""
  prompt_BP, lengths_B = prompt_rows.pad_prompts(prompts, PAD)
  batch, width = prompt_BP.shape
  rng = np.random.default_rng(seed)
  tokens = np.concatenate([prompt_BP, rng.integers(4, 100, (batch, gen_length))], 1)
  index = np.arange(width + gen_length)[None]
  offset = (width - lengths_B)[:, None]
  segments = (index >= offset).astype(np.int32)
  positions = np.maximum(index - offset, 0)
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(segments), jnp.asarray(positions), width


def slice_logits(module, tokens, segments, positions, kv, start, size):
  window = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=1)  # noqa: E731
  hidden, kv = module.hidden_kv(
    window(tokens),
    positions_BL=window(positions),
    segment_ids_BL=segments,
    kv_cache=kv,
    cache_start=start,
  )
  return module.logits(hidden), kv


def cached_and_uncached(
  model_config, params, sampling, prompts=PROMPTS, key=0, mesh=None, plain=True
):
  """(tokens of `sampling` on the fast path, tokens of the same settings uncached: the plain
  loop, unfused projections; plain=False, the fast path's own layout)."""
  none = dataclasses.replace(sampling, cache='none', cache_refresh=0)
  return (
    generate(model_config, params, sampling, key=key, prompts=prompts, mesh=mesh),
    generate(model_config, params, none, key=key, prompts=prompts, fuse=not plain),
  )
