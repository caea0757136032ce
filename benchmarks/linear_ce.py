"""python -m benchmarks.linear_ce [--tokens 16384 --vocab 50304 --dim 2048 --token_vocab 50289]

Times forward + backward of the output head + per-token CE, naive (the model's full f32 logits,
then `token_cross_entropy`) against `linear_cross_entropy`, and prints one JSON line: median ms
of each, the compiled temporary memory of each, the device's peak memory, and the largest
difference between the two losses and gradients; with --token_vocab also the fused version with
the padded columns masked (masked_over_fused: its cost). On CPU pass small sizes.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from dlmjax.diffusion import loss as loss_lib
from dlmjax.kernels.linear_cross_entropy import linear_cross_entropy

_TOKENS = flags.DEFINE_integer('tokens', 16384, 'tokens per step (batch x length)')
_VOCAB = flags.DEFINE_integer('vocab', 50304, 'vocabulary size')
_DIM = flags.DEFINE_integer('dim', 2048, 'model dimension')
_CHUNK = flags.DEFINE_integer('chunk_size', 4096, 'tokens per chunk of the fused version')
_DTYPE = flags.DEFINE_string('dtype', 'bfloat16', 'hidden-state dtype')
_ITERS = flags.DEFINE_integer('iters', 20, 'timed calls; the median is reported')
_TOKEN_VOCAB = flags.DEFINE_integer(
  'token_vocab',
  0,
  "the tokenizer's vocabulary below --vocab (e.g. 50289 of 50304): also time "
  'the fused version with the padding columns out of the softmax (0: skip)',
)
_NAIVE = flags.DEFINE_bool('naive', True, 'also time the naive version (needs ~3 T*V*4 bytes)')


def naive_ce(hidden_TD, weight_DV, targets_T):
  """What the loss does today: the model's f32 logits, then the f32 cross-entropy."""
  w_DV = weight_DV.astype(hidden_TD.dtype)
  logits_TV = jnp.einsum('td,dv->tv', hidden_TD, w_DV, preferred_element_type=jnp.float32)
  return loss_lib.token_cross_entropy(logits_TV, targets_T)


def _step(ce_fn):
  """jit(value_and_grad) of sum(ce * weights) w.r.t. hidden and head, as the loss uses it."""

  def loss(hidden_TD, weight_DV, targets_T, d_ce_T):
    return jnp.sum(ce_fn(hidden_TD, weight_DV, targets_T) * d_ce_T)

  return jax.jit(jax.value_and_grad(loss, (0, 1)))


def _time(step, args, iters):
  compiled = step.lower(*args).compile()
  analysis = compiled.memory_analysis()
  out = jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  temp = None if analysis is None else int(analysis.temp_size_in_bytes)
  return 1e3 * float(np.median(times)), temp, out


def _peak_bytes():
  stats = jax.devices()[0].memory_stats()
  return None if stats is None else stats.get('peak_bytes_in_use')


def run(tokens, vocab, dim, chunk_size, dtype, iters, naive=True, token_vocab=0) -> dict:
  k = jax.random.split(jax.random.key(0), 4)
  hidden_TD = jax.random.normal(k[0], (tokens, dim), jnp.float32).astype(dtype)
  weight_DV = jax.random.normal(k[1], (dim, vocab), jnp.float32) / np.sqrt(dim)
  targets_T = jax.random.randint(k[2], (tokens,), 0, vocab)
  d_ce_T = jax.random.uniform(k[3], (tokens,)) / tokens
  args = (hidden_TD, weight_DV, targets_T, d_ce_T)
  result = dict(
    device=jax.devices()[0].device_kind,
    tokens=tokens,
    vocab=vocab,
    dim=dim,
    chunk_size=chunk_size,
    dtype=jnp.dtype(dtype).name,
  )
  fused = _step(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=chunk_size))
  result['fused_ms'], result['fused_temp_bytes'], fused_out = _time(fused, args, iters)
  result['peak_bytes_after_fused'] = _peak_bytes()
  if token_vocab:  # the padded rows' -inf column bias (diffusion/loss.py column_bias)
    bias_V = np.where(np.arange(vocab) < token_vocab, 0.0, -np.inf).astype(np.float32)
    masked = _step(
      lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=chunk_size, bias_V=bias_V)
    )
    result['masked_fused_ms'] = _time(masked, args, iters)[0]
    result['masked_over_fused'] = result['masked_fused_ms'] / result['fused_ms']
  if naive:
    result['naive_ms'], result['naive_temp_bytes'], naive_out = _time(_step(naive_ce), args, iters)
    result['peak_bytes_after_naive'] = _peak_bytes()
    result['speedup'] = result['naive_ms'] / result['fused_ms']
    diffs = jax.tree.map(
      lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))), fused_out, naive_out
    )
    result['max_abs_diff'] = dict(zip(['loss', 'd_hidden', 'd_weight'], jax.tree.leaves(diffs)))
  # 2 FLOPs per multiply-add; the fused version does 4 head matmuls, the naive one 3.
  result['fused_tflops'] = 4 * 2 * tokens * dim * vocab / result['fused_ms'] / 1e9
  return result


def main(argv):
  del argv
  print(
    json.dumps(
      run(
        _TOKENS.value,
        _VOCAB.value,
        _DIM.value,
        _CHUNK.value,
        jnp.dtype(_DTYPE.value),
        _ITERS.value,
        _NAIVE.value,
        _TOKEN_VOCAB.value,
      )
    )
  )


if __name__ == '__main__':
  app.run(main)
