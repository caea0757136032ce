"""The forward process: MegaDLMs' rules, and randomness that depends on example ids only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax.diffusion import masking

MASK = 7


def _run(ids, tokens, length=None, step=3):
  keys = masking.example_keys(0, step, jnp.asarray(ids))
  length = tokens.shape[1] if length is None else length
  return [
    np.asarray(a)
    for a in masking.forward_process(keys, jnp.asarray(tokens), mask_id=MASK, length=length)
  ]


def test_masks_follow_the_rules():
  tokens = np.random.default_rng(0).integers(10, 100, size=(512, 64))
  noisy, masked, p = _run(np.arange(512), tokens)
  np.testing.assert_array_equal(noisy, np.where(masked, MASK, tokens))
  assert masked.any(axis=1).all(), 'at-least-one-mask rule'
  np.testing.assert_allclose(p, masked.sum(1) / 64)  # realised ratio, not t
  # t ~ U[0,1): the mean ratio is ~1/2 and the ratios spread over (0, 1).
  assert abs(p.mean() - 0.5) < 0.05
  assert p.min() < 0.1 and p.max() > 0.9


def test_masks_depend_on_example_id_not_position():
  tokens = np.random.default_rng(0).integers(10, 100, size=(8, 32))
  _, masked, _ = _run(np.arange(8), tokens)
  _, masked_perm, _ = _run(np.arange(8)[::-1], tokens[::-1])
  np.testing.assert_array_equal(masked_perm, masked[::-1])
  _, other_step, _ = _run(np.arange(8), tokens, step=4)
  assert (other_step != masked).any()


def test_truncated_positions_never_masked():
  tokens = np.random.default_rng(0).integers(10, 100, size=(64, 32))
  _, masked, p = _run(np.arange(64), tokens, length=5)
  assert not masked[:, 5:].any()
  assert masked[:, :5].any(axis=1).all()
  np.testing.assert_allclose(p, masked.sum(1) / 5)


def test_varlen_length_rate_and_range():
  lengths = np.array(
    [
      int(masking.varlen_length(0, s, m, seq_len=16, prob=0.1))
      for s in range(100)
      for m in range(4)
    ]
  )
  truncated = lengths[lengths < 16]
  assert 0.04 < (lengths < 16).mean() < 0.18
  assert truncated.min() >= 1
  assert int(masking.varlen_length(0, 5, 1, seq_len=16, prob=0.0)) == 16
  assert int(masking.varlen_length(0, 5, 1, seq_len=16, prob=1.0)) <= 16


def _packed(rows, length, rng):
  """Random rows of 2-4 documents each: (tokens, 1-based segment ids)."""
  segments = np.zeros((rows, length), np.int32)
  for b in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, length), size=rng.integers(1, 4), replace=False))
    segments[b] = 1 + np.searchsorted(cuts, np.arange(length), side='right')
  return rng.integers(10, 100, size=(rows, length)), segments


def test_segment_masks_follow_the_rules_per_document():
  rng = np.random.default_rng(0)
  tokens, segments = _packed(64, 48, rng)
  length = 40  # a truncated micro-batch: tokens past it are never masked or counted.
  keys = masking.example_keys(0, 3, jnp.arange(64))
  forward = jax.jit(
    functools.partial(masking.forward_process_segments, mask_id=MASK, length=length)
  )
  noisy, masked, p = (
    np.asarray(a) for a in forward(keys, jnp.asarray(tokens), jnp.asarray(segments))
  )
  np.testing.assert_array_equal(noisy, np.where(masked, MASK, tokens))
  assert not masked[:, length:].any()
  doc_ratios = []
  for b in range(64):
    for s in np.unique(segments[b, :length]):
      doc = (segments[b] == s) & (np.arange(48) < length)
      assert masked[b, doc].any(), 'at-least-one-mask rule, per document'
      np.testing.assert_allclose(p[b, doc], masked[b, doc].mean(), rtol=1e-6)
      doc_ratios.append((b, masked[b, doc].mean()))
  # t is drawn per document: documents of one row get different ratios.
  by_row = {}
  for b, r in doc_ratios:
    by_row.setdefault(b, []).append(r)
  spreads = [max(r) - min(r) for r in by_row.values() if len(r) > 1]
  assert np.mean(spreads) > 0.2


def test_segment_positions_restart():
  segments = jnp.array([[1, 1, 1, 2, 2, 3], [1, 2, 2, 2, 2, 2]])
  np.testing.assert_array_equal(
    masking.segment_positions(segments), [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
  )
