"""The pre-training losses against hand-written numpy statements of MegaDLMs' formulas."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.diffusion import loss as loss_lib
from dlmjax.diffusion import masking

V, MASK = 16, 15


def fake_model(table):
  """CE of logits = table[token]: a fixed function, so the formula is all that is tested."""

  def ce_fn(tokens_BL, targets_BL, valid_length_B=None):
    del valid_length_B
    return loss_lib.token_cross_entropy(jnp.asarray(table)[tokens_BL], targets_BL)

  return ce_fn


def jitted(fn, *args, **static):
  """fn with args and static bound, jitted."""
  return jax.jit(functools.partial(fn, *args, **static))


def mdm_loss_and_masks(ce_fn, tokens, *, seed, step, ids, varlen_prob, segment_ids=None, seen=None):
  """The loss under test and the forward process drawn from the keys the formula names (seed,
  step, example id) at the length the loss kept: one jitted program, as eagerly the dispatch of
  their many small ops takes most of a test's time on CPU. Returns (objective, sums, noisy,
  masked) as numpy, and fills `seen` with what ce_fn put there."""

  @jax.jit
  def fn(tokens, segment_ids):
    packed = {} if segment_ids is None else dict(segment_ids=segment_ids)
    objective, sums = loss_lib.mdm_loss(
      ce_fn,
      tokens,
      seed=seed,
      step=step,
      micro_index=0,
      example_ids_B=ids,
      mask_id=MASK,
      varlen_prob=varlen_prob,
      **packed,
    )
    keys, length = masking.example_keys(seed, step, ids), sums['length_sum'].astype(jnp.int32)
    if segment_ids is None:
      noisy, masked, _ = masking.forward_process(keys, tokens[:, :-1], mask_id=MASK, length=length)
    else:
      noisy, masked, _ = masking.forward_process_segments(
        keys, tokens[:, :-1], segment_ids[:, :-1], mask_id=MASK, length=length
      )
    return objective, sums, noisy, masked, dict(seen or {})

  *out, got = jax.device_get(fn(tokens, segment_ids))
  if seen is not None:
    seen.update(got)
  return out


def numpy_ce(logits, targets):
  logits = logits.astype(np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


@pytest.mark.parametrize('varlen_prob', [0.0, 1.0])
def test_mdm_loss_matches_formula(varlen_prob):
  rng = np.random.default_rng(0)
  table = rng.normal(size=(V, V)).astype(np.float32)
  tokens = rng.integers(0, MASK, size=(6, 21)).astype(np.int32)
  objective, sums, noisy, _ = mdm_loss_and_masks(
    fake_model(table), tokens, seed=1, step=2, ids=np.arange(6), varlen_prob=varlen_prob
  )
  length = int(sums['length_sum'])
  assert (length == 20) is (varlen_prob == 0.0)
  # Recover the masks the loss drew: the masked inputs are exactly the mask ids.
  m = noisy == MASK
  p = m.sum(1) / length
  ce = numpy_ce(table[noisy], tokens[:, :-1])
  num = (ce * m / p[:, None]).sum()
  den = 6 * length
  np.testing.assert_allclose(float(objective), num / den, rtol=1e-5)
  np.testing.assert_allclose(
    float(sums['masked_ce_sum'] / sums['masked_count']), (ce * m).sum() / m.sum(), rtol=1e-5
  )


def test_ar_loss_matches_formula():
  rng = np.random.default_rng(0)
  table = rng.normal(size=(V, V)).astype(np.float32)
  tokens = rng.integers(0, V, size=(3, 9)).astype(np.int32)
  objective, sums = jitted(
    loss_lib.ar_loss,
    fake_model(table),
    seed=0,
    step=0,
    micro_index=0,
    mask_id=MASK,
    varlen_prob=0.0,
  )(jnp.asarray(tokens), example_ids_B=jnp.arange(3))
  expected = numpy_ce(table[tokens[:, :-1]], tokens[:, 1:]).mean()
  np.testing.assert_allclose(float(objective), expected, rtol=1e-5)
  assert float(sums['loss_den']) == 24


def test_identity_per_row_mean_when_untruncated():
  """Reference 1.4: num/den = (1/B) sum_b mean over the masked tokens of row b."""
  rng = np.random.default_rng(3)
  table = rng.normal(size=(V, V)).astype(np.float32)
  tokens = rng.integers(0, MASK, size=(4, 33)).astype(np.int32)
  objective, _, noisy, m = mdm_loss_and_masks(
    fake_model(table), tokens, seed=0, step=0, ids=np.arange(4), varlen_prob=0.0
  )
  ce = numpy_ce(table[noisy], tokens[:, :-1])
  per_row = [(ce[b] * m[b]).sum() / m[b].sum() for b in range(4)]
  np.testing.assert_allclose(float(objective), np.mean(per_row), rtol=1e-5)


@pytest.mark.parametrize('varlen_prob', [0.0, 1.0])
def test_packed_mdm_loss_weights_each_document_by_its_ratio(varlen_prob):
  rng = np.random.default_rng(1)
  table = rng.normal(size=(V, V)).astype(np.float32)
  tokens = rng.integers(0, MASK, size=(4, 21)).astype(np.int32)
  segments = np.array(
    [[1] * 7 + [2] * 9 + [3] * 5, [1] * 21, [1] * 3 + [2] * 18, [1] * 10 + [2] * 11], np.int32
  )
  seen = {}

  def model(tokens_BL, targets_BL, valid_length_B=None, segment_ids_BL=None, positions_BL=None):
    del valid_length_B
    seen.update(segments=segment_ids_BL, positions=positions_BL)
    return loss_lib.token_cross_entropy(jnp.asarray(table)[tokens_BL], targets_BL)

  objective, sums, noisy, m = mdm_loss_and_masks(
    model,
    tokens,
    seed=1,
    step=2,
    ids=np.arange(4),
    varlen_prob=varlen_prob,
    segment_ids=segments,
    seen=seen,
  )
  length = int(sums['length_sum'])
  np.testing.assert_array_equal(seen['segments'], segments[:, :-1])
  assert seen['positions'][0, 7] == 0 and seen['positions'][0, 15] == 8
  assert (m == (noisy == MASK)).all()
  ce = numpy_ce(table[noisy], tokens[:, :-1])
  # sum over documents d of sum_{i in d, masked} CE_i / p_d, p_d = n_d / l_d, over all B*l tokens.
  num = 0.0
  for b in range(4):
    for s in np.unique(segments[b, :length]):
      doc = (segments[b, :-1] == s) & (np.arange(20) < length)
      p_d = m[b, doc].sum() / doc.sum()
      num += (ce[b, doc] * m[b, doc]).sum() / p_d
  np.testing.assert_allclose(float(objective), num / (4 * length), rtol=1e-5)


@pytest.mark.parametrize('chunk_size', [0, 8, 4096])
def test_model_cross_entropy_fused_equals_full_logits(chunk_size):
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel

  cfg = model_lib.ModelConfig(
    num_layers=1,
    d_model=32,
    num_heads=2,
    num_kv_heads=2,
    head_dim=16,
    ffn_dim=64,
    vocab_size=128,
    seq_len=16,
  )
  for tie in (False, True):
    c = dataclasses.replace(cfg, tie_embeddings=tie)
    module = model_lib.merge(c, model_lib.init_params(c, jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
    targets = jax.random.randint(jax.random.key(2), (2, 16), 0, 128)
    expected = loss_lib.token_cross_entropy(module(tokens), targets)
    got = loss_lib.model_cross_entropy(module, tokens, targets, chunk_size=chunk_size)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('chunk_size', [0, 8])
def test_shifted_model_cross_entropy_is_the_formula_on_shifted_logits(chunk_size):
  """model.shift_logits through the loss's model path (full logits, and the fused head + CE):
  CE_i = logsumexp(l_{i-1}) - l_{i-1}[y_i] with l the unshifted model's logits (l_{-1} := l_0),
  as Dream's SFT trainer shifts them against unshifted labels."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel

  cfg = model_lib.ModelConfig(
    num_layers=1,
    d_model=32,
    num_heads=2,
    num_kv_heads=2,
    head_dim=16,
    ffn_dim=64,
    vocab_size=128,
    seq_len=16,
    qk_norm=False,
    qkv_bias=True,
  )
  params = model_lib.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 128)
  targets = jax.random.randint(jax.random.key(2), (2, 16), 0, 128)
  logits = np.asarray(model_lib.merge(cfg, params)(tokens), np.float64)
  shifted_logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
  shifted = model_lib.merge(dataclasses.replace(cfg, shift_logits=True), params)
  got = loss_lib.model_cross_entropy(shifted, tokens, targets, chunk_size=chunk_size)
  np.testing.assert_allclose(got, numpy_ce(shifted_logits, np.asarray(targets)), rtol=1e-5)


# ---- The softmax over the tokenizer's vocabulary (padding rows out), and BD3LM's SUBS ----


def _log_softmax_np(logits, keep):
  """log p over the kept columns only, written out: z - log sum_{kept} exp z."""
  z = np.asarray(logits, np.float64)[..., keep]
  return (
    z
    - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - z.max(-1, keepdims=True)
  )


@pytest.mark.parametrize('chunk_size', [0, 8])
def test_cross_entropy_leaves_out_padded_rows_and_subs_mask(chunk_size):
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel
  from tests.conftest import tiny_test_config  # pylint: disable=import-outside-toplevel

  config = tiny_test_config(**{'model.vocab_size': 200, 'model.mask_token_id': 199})
  cfg = model_lib.ModelConfig.from_config(config)
  assert cfg.vocab_size == 256 and cfg.token_vocab_size == 200
  module = model_lib.merge(cfg, model_lib.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(rng.integers(0, 200, (2, 8)), jnp.int32)
  targets = jnp.asarray(rng.integers(0, 199, (2, 8)), jnp.int32)
  logits = np.asarray(module(inputs))
  rows = np.arange(2)[:, None], np.arange(8)[None, :]
  for excluded, keep in (((), np.arange(200)), ((199,), np.arange(199))):
    expected = -_log_softmax_np(logits, keep)[(*rows, np.asarray(targets))]
    ce = jax.jit(
      lambda i, t, e=excluded: loss_lib.model_cross_entropy(
        module, i, t, chunk_size=chunk_size, exclude_ids=e
      )
    )(inputs, targets)
    np.testing.assert_allclose(np.asarray(ce), expected, rtol=1e-5, atol=1e-5)
  # The padded rows get no gradient through the softmax (the fused head's backward included).
  grad = jax.grad(
    lambda m: loss_lib.model_cross_entropy(m, inputs, targets, chunk_size=chunk_size).sum()
  )(module)
  head = np.asarray(grad.head_weight_DV())
  assert np.abs(head[:, 200:]).max() == 0 and np.abs(head[:, :200]).max() > 0


def test_block_objective_defaults_to_subs_and_mdm_keeps_plain_ce():
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  c = config_lib.defaults()
  assert loss_lib.excluded_ids(c) == ()  # mdm: MegaDLMs' / LLaDA's CE over the whole vocabulary
  c.diffusion.objective = 'block'
  assert loss_lib.excluded_ids(c) == (c.model.mask_token_id,)  # bd3lm.yaml: parameterization subs
  c.diffusion.block_parameterization = 'plain'
  assert loss_lib.excluded_ids(c) == ()
