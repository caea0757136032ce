"""The distillation objectives against their papers' formulas, written out by hand in numpy:
dParallel's certainty forcing and d3LLM's trajectory-ordered masking (tiny shapes, jitted)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.data.roles import PADDING, PROMPT, RESPONSE
from dlmjax.diffusion import distill
from dlmjax.diffusion.distill import base as distill_base

B, S, V, MASK = 3, 14, 9, 8
BLOCK = 4


def _rows():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MASK, (B, S + 1)).astype(np.int32)
  roles = np.full((B, S + 1), RESPONSE, np.int32)
  for row, prompt in enumerate((2, 3, 5)):
    roles[row, :prompt] = PROMPT
  roles[0, 11:] = PADDING
  roles[1, 7:] = PADDING
  steps = rng.permutation(S + 1)[None].repeat(B, 0).astype(np.int32)
  steps[:, :2] = -1
  return tokens, roles, steps


TABLE = np.random.default_rng(1).normal(size=(V, V)).astype(np.float32) * 3


def _right(tokens_BL, valid_length_B):
  """Each token's right neighbour, token 0 where it lies past the row's canvas end (unseen)."""
  right = jnp.roll(tokens_BL, -1, axis=1)
  seen = jnp.arange(1, tokens_BL.shape[1] + 1)[None] < valid_length_B[:, None]
  return jnp.where(seen, right, 0)


def _logits(noisy_BL, valid_length_B):
  """A student whose logits at i depend on its token and its right neighbour (if seen)."""
  right = _right(noisy_BL, valid_length_B)
  return jnp.asarray(TABLE)[noisy_BL] + 0.5 * jnp.asarray(TABLE)[right][..., ::-1]


def _terms(noisy_BL, clean_BL, targets_BL, valid_length_B):
  del clean_BL
  return distill_base.logit_terms(_logits(noisy_BL, valid_length_B), targets_BL, temperature=0.5)


def _settings(**kw):
  return dict(mask_id=MASK, block_size=BLOCK, temperature=0.5, certainty_weight=2.0) | kw


@functools.partial(jax.jit, static_argnames=('name',))
def _run(name, tokens, roles, steps, key, progress):
  objective = distill.get(name)
  settings = _settings(progress=progress)
  keys = jax.random.split(key, B)
  extra = {'commit_steps': steps} if name == 'trajectory' else {}
  loss, _ = distill_base.distill_loss(
    objective, _terms, tokens, roles, keys_B=keys, settings=settings, **extra
  )
  maskable, ends = distill_base.maskable_rows(keys, roles[:, :-1])
  masks = distill_base.pass_masks(
    objective, keys, maskable, {k: v[:, :-1] for k, v in extra.items()}, settings
  )
  return loss, masks, ends


def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _hand_terms(tokens, masks, ends):
  """CE_k = -(1/|M_k|) sum log softmax(z)[y]; H_k = (1/|M_c|) sum_{argmax z = y} H(softmax(z/T))."""
  x = tokens[:, :-1]
  primary, reverse, future = (np.asarray(m) for m in masks)
  out = []
  for m in (primary, reverse):
    noisy = np.where(m | future, MASK, x)
    z = np.asarray(_logits(jnp.asarray(noisy), jnp.asarray(ends)), np.float64)
    logp = _log_softmax(z)
    ce = -sum(logp[b, i, x[b, i]] for b, i in zip(*np.nonzero(m))) / max(m.sum(), 1)
    q = np.exp(_log_softmax(z / 0.5))
    h = -(q * np.log(q + 1e-12)).sum(-1)
    right = m & (z.argmax(-1) == x)
    cert = (h * right).sum() / max(right.sum(), 1)
    out += [ce, cert]
  return out  # ce, cert, ce_rev, cert_rev


def _check_block(masks, roles, ends):
  """The active block is a block_size-aligned span of the response up to the row's canvas end
  (the last block runs to that end, at least the answer's), the passes partition it, the
  future is the response after it, context and prompt are clean."""
  primary, reverse, future = (np.asarray(m) for m in masks)
  active = primary | reverse
  assert not (primary & reverse).any()
  answered = (roles[:, :-1] != PADDING).sum(1)
  assert (ends >= answered).all() and (ends <= S).all()
  for b in range(B):
    response = np.flatnonzero(roles[b, : ends[b]] != PROMPT)
    first, n_resp = response[0], len(response)
    span = np.flatnonzero(active[b])
    assert len(span) > 0 or n_resp % BLOCK == 0
    if len(span):
      start = span[0]
      assert (start - first) % BLOCK == 0
      n = (start - first) // BLOCK
      end = ends[b] if n == n_resp // BLOCK else start + BLOCK
      np.testing.assert_array_equal(span, np.arange(start, end))
      np.testing.assert_array_equal(np.flatnonzero(future[b]), np.arange(end, ends[b]))


def test_certainty_is_dparallel_formula():
  tokens, roles, steps = _rows()
  cut = []
  for seed in range(3):
    loss, masks, ends = _run('certainty', tokens, roles, steps, jax.random.key(seed), 0.0)
    cut += list(np.asarray(ends) < S)
    _check_block(masks, roles, np.asarray(ends))
    ce, cert, ce_rev, cert_rev = _hand_terms(tokens, masks, ends)
    want = ce + ce_rev + 2.0 * (cert + cert_rev)  # LLaDA: beta = entropy_weight = 2
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  assert any(cut)  # some row's canvas ended before the row's end


def test_trajectory_masks_the_late_tokens_and_is_d3llm_formula():
  tokens, roles, steps = _rows()
  for seed, progress in ((0, 0.0), (1, 0.5), (2, 1.0)):
    loss, masks, ends = _run('trajectory', tokens, roles, steps, jax.random.key(seed), progress)
    _check_block(masks, roles, np.asarray(ends))
    primary, reverse, _ = (np.asarray(m) for m in masks)
    for b in range(B):
      block = np.flatnonzero(primary[b] | reverse[b])
      late = np.flatnonzero(primary[b])
      order = sorted(block, key=lambda i: (steps[b, i] if steps[b, i] >= 0 else 1 << 30, i))
      # the masked ones are a tail of the block's commit order (kept = the first k)
      assert sorted(order[len(block) - len(late) :]) == list(late)
      if progress == 1.0 and len(block):  # r = 0.8 exactly: k = int(0.2 n)
        assert len(block) - len(late) == int(np.floor(0.2 * len(block) + 1e-6))
    ce, cert, ce_rev, _ = _hand_terms(tokens, masks, ends)
    want = (ce + ce_rev + 2.0 * cert) / 4  # d3LLM LLaDA: certainty on the primary pass only
    np.testing.assert_allclose(float(loss), want, rtol=2e-5)


def test_certainty_gradient_flows_through_the_entropy_only():
  """The M_c selection carries no gradient; H does: d/dz of the term is finite and nonzero."""
  z = jnp.asarray(np.random.default_rng(2).normal(size=(1, 4, V)), jnp.float32)
  y = jnp.argmax(z, -1).astype(jnp.int32)

  def term(z):
    _, entropy, hit = distill_base.logit_terms(z, y, temperature=0.5)
    return distill_base.certainty(entropy, hit, jnp.ones((1, 4), bool))

  grad = jax.grad(term)(z)
  assert np.isfinite(np.asarray(grad)).all() and float(jnp.abs(grad).sum()) > 0


class _Student:
  """A student reduced to what model_terms reads: hidden states (an embedding of the token and
  its right neighbour) and an output head over V_PADDED rows, the last ones padding."""

  def __init__(self, params):
    self.embed, self.head = params

  def hidden(self, tokens_BL, valid_length_B):
    return self.embed[tokens_BL] + 0.5 * self.embed[_right(tokens_BL, valid_length_B)][..., ::-1]

  def head_weight_DV(self):
    return self.head

  def __call__(self, tokens_BL, valid_length_B):
    return jnp.einsum('bld,dv->blv', self.hidden(tokens_BL, valid_length_B), self.head)


V_PADDED, DIM = 16, 8


def test_fused_head_loss_equals_the_full_logits_loss(name='certainty'):
  """model_terms from the fused output head (the SFT loss's, chunk_size > 0) gives the full
  logits' loss and gradients, the padded vocabulary rows left out of both softmaxes."""
  rng = np.random.default_rng(5)
  params = (
    jnp.asarray(rng.normal(size=(V_PADDED, DIM)), jnp.float32),
    jnp.asarray(rng.normal(size=(DIM, V_PADDED)), jnp.float32),
  )
  bias_V = np.zeros(V_PADDED, np.float32)
  bias_V[V:] = -np.inf  # rows V.. are the vocabulary's padding
  tokens, roles, steps = _rows()
  extra = {'commit_steps': steps} if name == 'trajectory' else {}
  settings = _settings(progress=0.3)
  keys = jax.random.split(jax.random.key(4), B)
  maskable, ends = distill_base.maskable_rows(keys, roles[:, :-1])
  arrays = {k: v[:, :-1] for k, v in extra.items()}
  primary, _, future = (
    np.asarray(m)
    for m in distill_base.pass_masks(distill.get(name), keys, maskable, arrays, settings)
  )
  # The primary pass's targets are the student's own argmax there, so the certainty term counts.
  noisy = np.where(primary | future, MASK, tokens[:, :-1])
  guess = np.asarray(_Student(params)(jnp.asarray(noisy), ends))[..., :V].argmax(-1)
  tokens = tokens.copy()
  tokens[:, :-1] = np.where(primary, guess, tokens[:, :-1])
  assert primary.sum() > 0

  @functools.partial(jax.jit, static_argnums=1)
  @functools.partial(jax.value_and_grad, has_aux=True)
  def loss(params, chunk_size):
    def terms_fn(noisy, clean, targets, valid_length_B):
      return distill_base.model_terms(
        _Student(params),
        noisy,
        targets,
        temperature=0.5,
        chunk_size=chunk_size,
        bias_V=bias_V,
        valid_length_B=valid_length_B,
      )

    value, sums = distill_base.distill_loss(
      distill.get(name), terms_fn, tokens, roles, keys_B=keys, settings=settings, **extra
    )
    return value, sums['certainty_sum']

  (full, cert), d_full = loss(params, 0)
  (fused, cert_fused), d_fused = loss(params, 16)
  assert float(cert) > 0  # the entropy term is in the loss
  np.testing.assert_allclose(
    [float(fused), float(cert_fused)], [float(full), float(cert)], rtol=1e-5
  )
  for a, b in zip(d_fused, d_full):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())
  head = np.asarray(d_fused[1])
  assert np.abs(head[:, V:]).max() == 0 and np.abs(head[:, :V]).max() > 0


def test_unknown_objective_names_the_known_ones():
  with pytest.raises(ValueError, match='certainty'):
    distill.get('nope')
