"""The forward process: MegaDLMs' rules, and randomness that depends on example ids only."""

import jax.numpy as jnp
import numpy as np

from dlmjax.diffusion import masking

MASK = 7


def _run(ids, tokens, length=None, step=3):
  keys = masking.example_keys(0, step, jnp.asarray(ids))
  length = tokens.shape[1] if length is None else length
  return [np.asarray(a) for a in masking.forward_process(keys, jnp.asarray(tokens), mask_id=MASK,
                                                         length=length)]


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
  lengths = np.array([int(masking.varlen_length(0, s, m, seq_len=16, prob=0.1))
                      for s in range(100) for m in range(4)])
  truncated = lengths[lengths < 16]
  assert 0.04 < (lengths < 16).mean() < 0.18
  assert truncated.min() >= 1
  assert int(masking.varlen_length(0, 5, 1, seq_len=16, prob=0.0)) == 16
  assert int(masking.varlen_length(0, 5, 1, seq_len=16, prob=1.0)) <= 16
