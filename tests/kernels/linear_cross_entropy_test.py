"""The fused head + CE against the plain full-logits formula: values, grads, sharding, memory."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dlmjax.kernels.linear_cross_entropy import (
  linear_cross_entropy,
  linear_cross_entropy_and_entropy,
)

T, D, V = 64, 16, 96


@pytest.fixture(autouse=True)
def _strict_ranks():
  with jax.numpy_rank_promotion('raise'):
    yield


def reference_ce(hidden_TD, weight_DV, targets_T):
  """The naive head: full f32 [T, V] logits, then logsumexp minus the target logit."""
  w_DV = weight_DV.astype(hidden_TD.dtype)
  logits_TV = jnp.einsum('td,dv->tv', hidden_TD, w_DV, preferred_element_type=jnp.float32)
  target_T = jnp.take_along_axis(logits_TV, targets_T[:, None], axis=-1)[:, 0]
  return jax.nn.logsumexp(logits_TV, axis=-1) - target_T


def inputs(seed=0, num_tokens=T):
  k = jax.random.split(jax.random.key(seed), 4)
  hidden_TD = 2.0 * jax.random.normal(k[0], (num_tokens, D), jnp.float32)
  weight_DV = jax.random.normal(k[1], (D, V), jnp.float32)
  targets_T = jax.random.randint(k[2], (num_tokens,), 0, V)
  # Non-uniform cotangents like the loss's mask/p/den weights, with some zeros (unmasked tokens).
  d_ce_T = jax.random.uniform(k[3], (num_tokens,), minval=-1.0, maxval=3.0)
  return hidden_TD, weight_DV, targets_T, jnp.where(d_ce_T < 0, 0.0, d_ce_T)


def value_and_grads(ce_fn, hidden_TD, weight_DV, targets_T, d_ce_T):
  def loss(h, w):
    ce_T = ce_fn(h, w, targets_T)
    return jnp.sum(ce_T * d_ce_T), ce_T

  (_, ce_T), (d_h, d_w) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
    hidden_TD, weight_DV
  )
  return ce_T, d_h, d_w


def assert_close(got, want, rtol, atol_frac=0.0):
  """Elementwise rtol plus an absolute slack of atol_frac times the reference's largest entry."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_allclose(got, want, rtol=rtol, atol=atol_frac * np.abs(want).max() + 1e-6)


@pytest.mark.parametrize('chunk_size', [T, 16, 24, 7, 1000])
def test_float32_matches_reference(chunk_size):
  """24 and 7 do not divide T = 64: the chunks are padded and the padding must add nothing."""
  h, w, t, g = inputs()
  fused = functools.partial(linear_cross_entropy, chunk_size=chunk_size)
  want_all = value_and_grads(reference_ce, h, w, t, g)
  for got, want in zip(value_and_grads(fused, h, w, t, g), want_all):
    assert got.dtype == want.dtype == jnp.float32
    assert_close(got, want, rtol=1e-5, atol_frac=1e-6)


@pytest.mark.parametrize(
  'hidden_dtype,compute_dtype', [(jnp.bfloat16, None), (jnp.float32, jnp.bfloat16)]
)
def test_bfloat16_matches_reference(hidden_dtype, compute_dtype):
  """Reference: the f32 formula on the bf16-rounded hidden and weight, so only our own rounding
  shows. The loss values share the bf16 products and f32 sums (rtol 1e-5); the gradients round
  d_logits to bf16 before their two matmuls (relative error 2^-9 per entry, as autodiff of a bf16
  head does), and d_hidden is returned in bf16: 2e-2 relative plus 1e-2 of the largest entry."""
  h, w, t, g = inputs(seed=1)
  h = h.astype(hidden_dtype)
  fused = functools.partial(linear_cross_entropy, chunk_size=24, compute_dtype=compute_dtype)
  ce, d_h, d_w = value_and_grads(fused, h, w, t, g)
  assert (ce.dtype, d_h.dtype, d_w.dtype) == (jnp.float32, hidden_dtype, jnp.float32)
  h32, w32 = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (h, w))
  ref_ce, ref_d_h, ref_d_w = value_and_grads(reference_ce, h32, w32, t, g)
  assert_close(ce, ref_ce, rtol=1e-5, atol_frac=1e-6)
  assert_close(d_h, ref_d_h, rtol=2e-2, atol_frac=1e-2)
  assert_close(d_w, ref_d_w, rtol=2e-2, atol_frac=1e-2)


def test_no_gradient_for_targets():
  h, w, t, g = inputs()
  _, vjp = jax.vjp(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=16), h, w, t)
  _, _, d_t = vjp(g)
  assert d_t.dtype == jax.dtypes.float0 and d_t.shape == t.shape


def reference_terms(hidden_TD, weight_DV, targets_T, bias_V, temperature):
  """Full f32 logits z = h W + b: CE, the entropy of softmax(z / T) (0 log 0 = 0), argmax == y."""
  z_TV = jnp.einsum('td,dv->tv', hidden_TD, weight_DV, preferred_element_type=jnp.float32)
  z_TV = z_TV + bias_V[None]
  ce_T = jax.nn.logsumexp(z_TV, axis=-1) - jnp.take_along_axis(z_TV, targets_T[:, None], -1)[:, 0]
  q_TV = jax.nn.softmax(z_TV / temperature, axis=-1)
  log_q_TV = jax.nn.log_softmax(z_TV / temperature, axis=-1)
  entropy_T = -jnp.sum(q_TV * jnp.where(q_TV > 0, log_q_TV, 0.0), axis=-1)  # no nan gradient
  hit_T = (jnp.argmax(z_TV, axis=-1) == targets_T).astype(jnp.float32)
  return ce_T, entropy_T, hit_T


@pytest.mark.parametrize('chunk_size,temperature', [(T, 0.5), (24, 0.5), (7, 1.3)])
def test_entropy_and_hits_match_the_full_logits(chunk_size, temperature):
  """The certainty term's inputs from the fused head (padding columns at -inf, half the targets
  the argmax): values, and the gradients of g_ce . CE + g_H . H against autodiff of the full
  logits."""
  h, w, t, g = inputs(seed=3)
  bias_V = jnp.zeros((V,), jnp.float32).at[V - 5 :].set(-jnp.inf)
  z = h @ w + bias_V[None]
  t = jnp.where(jnp.arange(T) % 2 == 0, jnp.argmax(z, -1), t % (V - 5))
  g_h = jnp.flip(g) + 0.5

  def run(fn):
    def loss(h, w):
      ce, entropy, hit = fn(h, w)
      return jnp.sum(ce * g) + jnp.sum(entropy * g_h), (ce, entropy, hit)

    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(h, w)

  fused = functools.partial(
    linear_cross_entropy_and_entropy, temperature=temperature, chunk_size=chunk_size, bias_V=bias_V
  )
  (_, got), got_grads = run(lambda h, w: fused(h, w, t))
  (_, want), want_grads = run(lambda h, w: reference_terms(h, w, t, bias_V, temperature))
  for a, b in zip(got, want):
    assert_close(a, b, rtol=1e-5, atol_frac=1e-6)
  # d H / d z = -q (log q + H) / T cancels on peaked rows: both sides are f32, 1e-5 of the largest.
  for a, b in zip(got_grads, want_grads):
    assert a.dtype == jnp.float32
    assert_close(a, b, rtol=1e-5, atol_frac=1e-5)
  assert 0 < float(got[2].sum()) < T  # both hits and misses
  assert float(got[1].min()) > 0  # no token is one-hot: every entropy has a gradient
  ce_only = jax.jit(functools.partial(linear_cross_entropy, chunk_size=chunk_size, bias_V=bias_V))
  assert_close(ce_only(h, w, t), want[0], rtol=1e-5, atol_frac=1e-6)
  with pytest.raises(ValueError, match='temperature'):
    linear_cross_entropy_and_entropy(h, w, t, temperature=0.0)


def _big_float_vars(jaxpr, limit):
  """Shapes of float32 values with at least `limit` elements, in a jaxpr and all its sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      aval = var.aval
      if getattr(aval, 'dtype', None) == jnp.float32 and np.prod(aval.shape) >= limit:
        found.append(aval.shape)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else [param]:
        sub = getattr(sub, 'jaxpr', sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, 'eqns'):
          found += _big_float_vars(sub, limit)
  return found


def test_forward_and_backward_never_hold_full_logits():
  """No f32 value as large as [T, V] in the gradient's jaxpr; the check catches the naive head."""
  h, w, t, g = inputs()

  def grad_jaxpr(ce_fn):
    def loss(h, w):
      return jnp.sum(ce_fn(h, w, t) * g)

    return jax.make_jaxpr(jax.grad(loss, (0, 1)))(h, w).jaxpr

  fused = functools.partial(linear_cross_entropy, chunk_size=16)
  assert _big_float_vars(grad_jaxpr(fused), T * V) == []
  assert (T, V) in _big_float_vars(grad_jaxpr(reference_ce), T * V)


def _mesh():
  return Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ('data', 'tensor'))


@pytest.mark.parametrize(
  'weight_spec,token_shards', [(P(), 1), (P(), 4), (P(None, 'tensor'), 4), (P('data', None), 8)]
)
def test_sharded_matches_unsharded(weight_spec, token_shards):
  """Tokens over 'data'; the weight replicated, vocab-sharded over 'tensor', or fsdp-like on D."""
  mesh = _mesh()
  h, w, t, g = inputs(seed=2)
  want = value_and_grads(reference_ce, h, w, t, g)

  def on(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))

  fused = functools.partial(linear_cross_entropy, chunk_size=32, token_shards=token_shards)
  got = value_and_grads(
    fused, on(h, P('data')), on(w, weight_spec), on(t, P('data')), on(g, P('data'))
  )
  for a, b in zip(got, want):
    assert_close(a, b, rtol=1e-5, atol_frac=1e-6)


def _loop_body_collectives(token_shards):
  """Element counts of the all-reduces XLA placed inside loop bodies (any computation but ENTRY)."""
  mesh = _mesh()
  h, w, t, g = inputs()

  def loss(h, w):
    return jnp.sum(linear_cross_entropy(h, w, t, chunk_size=16, token_shards=token_shards) * g)

  h_sharded = jax.device_put(h, NamedSharding(mesh, P('data')))
  w_replicated = jax.device_put(w, NamedSharding(mesh, P()))
  hlo = jax.jit(jax.grad(loss, (0, 1))).lower(h_sharded, w_replicated).compile().as_text()
  sizes, in_entry = [], False
  for line in hlo.splitlines():
    if line and not line[0].isspace():
      in_entry = line.startswith('ENTRY')
    elif not in_entry and ' all-reduce(' in line:
      for dims in re.findall(r'f32\[([\d,]*)\]', line.split(' all-reduce(')[0]):
        sizes.append(int(np.prod([int(d) for d in dims.split(',') if d])))
  return sizes


def test_token_shards_moves_weight_gradient_sum_out_of_the_loop():
  """With token_shards = data devices, d_W is summed across devices once, not once per chunk."""
  assert D * V in _loop_body_collectives(token_shards=1)
  assert D * V not in _loop_body_collectives(token_shards=4)


def test_rejects_bad_arguments():
  h, w, t, _ = inputs()
  with pytest.raises(ValueError, match='token_shards'):
    linear_cross_entropy(h, w, t, chunk_size=24, token_shards=4)  # 22 rows per chunk
  with pytest.raises(ValueError, match='do not match'):
    linear_cross_entropy(h, w, t[:-1])
