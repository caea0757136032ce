"""diffusion.objective=block against hand-written statements of BD3LM's training.

The two-stream forward is checked against its meaning: noisy block b's predictions are those of a
plain block-causal model reading [clean blocks < b, noisy block b]. The loss is checked against
sum CE * m / t / (B * l) computed in numpy from those per-block forwards.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.data.roles import PROMPT, RESPONSE
from dlmjax.diffusion import loss as loss_lib
from dlmjax.diffusion import masking, sft_loss
from tests.conftest import tiny_test_config

BLOCK, SEQ, MASK = 4, 16, 3


@pytest.fixture(scope='module')
def module():
  config = tiny_test_config(
    **{
      'model.attention_mask': 'block_causal',
      'model.block_size': BLOCK,
      'model.num_layers': 1,
      'model.d_model': 32,
      'model.num_heads': 2,
      'model.num_kv_heads': 1,
      'model.ffn_dim': 64,
      'model.seq_len': SEQ,
      'model.vocab_size': VOCAB,
      'model.mask_token_id': MASK,
    }
  )
  cfg = model_lib.ModelConfig.from_config(config)
  return model_lib.merge(cfg, model_lib.init_params(cfg, jax.random.key(0)))


VOCAB = 64  # the tokenizer's; the embedding pads it to 128 rows, which no softmax includes


def numpy_ce(logits, targets, keep=np.arange(VOCAB)):
  """CE written out over the kept columns: the tokenizer's vocabulary (SUBS: less MASK)."""
  logits = np.where(
    np.isin(np.arange(logits.shape[-1]), keep), np.asarray(logits, np.float64), -np.inf
  )
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def per_block_logits(module, noisy, clean):
  """Noisy block b read by the block_causal model on [clean[:bB], noisy[bB:(b+1)B]].

  Blocks after b cannot reach block b under block_causal attention, so each b's sequence is
  clean[:bB] ++ noisy[bB:], all of them in one batch. Blocks count from position 0 (the last
  may be short).
  """
  rows, length = noisy.shape
  num_blocks = -(-length // BLOCK)
  tokens = np.concatenate(
    [np.concatenate([clean[:, : b * BLOCK], noisy[:, b * BLOCK :]], 1) for b in range(num_blocks)]
  )
  seg = np.ones_like(tokens)
  logits = np.asarray(_segment_logits(module, jnp.asarray(tokens), jnp.asarray(seg)))
  return np.concatenate(
    [logits[b * rows : (b + 1) * rows, b * BLOCK : (b + 1) * BLOCK] for b in range(num_blocks)], 1
  )


def packed_per_block_logits(module, noisy, clean, segments):
  """per_block_logits of each packed document on its own (unpacked, from its position 0), put
  back in place: what per-document blocks mean."""
  out = np.zeros((*noisy.shape, module.cfg.vocab_size), np.float32)
  for r in range(noisy.shape[0]):
    for d in np.unique(segments[r]):
      cols = np.flatnonzero(segments[r] == d)
      part = slice(cols[0], cols[-1] + 1)
      out[r, part] = per_block_logits(module, noisy[r : r + 1, part], clean[r : r + 1, part])[0]
  return out


@functools.partial(jax.jit, static_argnums=0)
def _segment_logits(module, tokens, seg):
  return module(tokens, segment_ids_BL=seg, positions_BL=masking.segment_positions(seg))


@functools.partial(jax.jit, static_argnums=0)
def _two_stream_logits(module, noisy, clean, seg):
  hidden = module.hidden(
    noisy, clean_BL=clean, segment_ids_BL=seg, positions_BL=masking.segment_positions(seg)
  )
  return module.logits(hidden)


def test_two_stream_forward_is_each_block_on_its_clean_prefix(module):
  rng = np.random.default_rng(0)
  clean = rng.integers(4, 64, (2, SEQ)).astype(np.int32)
  noisy = np.where(rng.random((2, SEQ)) < 0.5, MASK, clean).astype(np.int32)
  # Documents starting off the block grid (6, 7): their blocks count from their own start.
  segments = np.array([[1] * SEQ, [1] * 6 + [2] * 7 + [3] * 3], np.int32)
  got = _two_stream_logits(module, *(jnp.asarray(a) for a in (noisy, clean, segments)))
  assert got.shape[:2] == (2, SEQ)  # the clean stream never reaches the head
  want = packed_per_block_logits(module, noisy, clean, segments)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)


PACKED = np.array([[1] * 7 + [2] * 9, [1] * 3 + [2] * 13], np.int32)


@pytest.mark.parametrize(
  'chunk_size, packed, subs', [(0, False, False), (8, False, True), (0, True, True)]
)  # full logits, the fused head + CE, packed documents (blocks from each one's start); SUBS:
# BD3LM's MASK logit at -inf before the log-softmax (the block objective's default)
def test_block_loss_matches_the_per_block_formula(module, chunk_size, packed, subs):
  rng = np.random.default_rng(1)
  tokens = rng.integers(4, 64, (2, SEQ + 1)).astype(np.int32)
  segments = np.concatenate([PACKED, PACKED[:, -1:]], 1) if packed else None
  ids = jnp.array([5, 9])
  excluded = (MASK,) if subs else ()
  ce_fn = functools.partial(
    loss_lib.model_cross_entropy, module, chunk_size=chunk_size, exclude_ids=excluded
  )
  kw = dict(seed=7, step=3, micro_index=0, example_ids_B=ids, mask_id=MASK, block_size=BLOCK)
  objective, sums = jax.jit(
    lambda t, s: loss_lib.block_loss(ce_fn, t, varlen_prob=0.0, segment_ids=s, **kw)
  )(jnp.asarray(tokens), None if segments is None else jnp.asarray(segments))
  # The noise the loss drew: from the example's key, as masking.example_keys names it.
  x = tokens[:, :-1]
  noisy, masked, t = (
    np.asarray(a)
    for a in _noise(
      masking.example_keys(7, 3, ids),
      jnp.asarray(x),
      jnp.ones(x.shape, bool),
      BLOCK,
      loss_lib.BLOCK_TIME_EPS,
      None if segments is None else jnp.asarray(PACKED),
    )
  )
  assert np.all(noisy == np.where(masked, MASK, x)) and masked.any() and not masked.all()
  if packed:
    logits = packed_per_block_logits(module, noisy, x, PACKED)
  else:
    logits = per_block_logits(module, noisy, x)
  keep = np.setdiff1d(np.arange(VOCAB), excluded)
  want = np.sum(numpy_ce(logits, x, keep) * masked / t) / x.size
  np.testing.assert_allclose(float(objective), want, rtol=2e-5)
  assert float(sums['loss_den']) == x.size  # real tokens: L per row, not 2L
  assert float(sums['masked_count']) == masked.sum()


@functools.partial(jax.jit, static_argnums=(3, 4))
def _noise(keys, x, maskable, block_size, eps, segments=None):
  return masking.block_forward_process(
    keys, x, maskable, block_size=block_size, mask_id=MASK, eps=eps, segment_ids_BL=segments
  )


def per_document_blocks(segments_L, block_size):
  """Numpy: each token's block, blocks of block_size counted from each document's first token."""
  blocks, count, previous, offset = [], -1, None, 0
  for d in segments_L.tolist():
    offset = 0 if d != previous else offset + 1
    count += offset % block_size == 0
    blocks.append(count)
    previous = d
  return np.array(blocks)


def test_block_noise_restarts_at_each_document():
  rows = 64
  keys = masking.example_keys(0, 0, jnp.arange(rows))
  segments = np.array([1] * 5 + [2] * 9 + [3] * 2, np.int32)  # blocks 4+1, 4+4+1, 2: 6 of them
  x = jnp.full((rows, SEQ), 7, jnp.int32)
  maskable = jnp.ones(x.shape, bool)
  seg = jnp.broadcast_to(jnp.asarray(segments), x.shape)
  _, masked, t = (np.asarray(a) for a in _noise(keys, x, maskable, BLOCK, 1e-3, seg))
  blocks = per_document_blocks(segments, BLOCK)
  assert blocks.tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 5, 5]
  for j in range(6):  # one t per document block ...
    assert np.all(t[:, blocks == j] == t[:, blocks == j][:, :1])
  u = (t[:, np.searchsorted(blocks, np.arange(6))] - 1e-3) / (1 - 1e-3)
  # ... stratified over the row's 6 blocks: one in each sixth of [0, 1].
  assert np.all(np.sort(np.floor(u * 6), -1) == np.arange(6))
  rate = masked.sum() / t.sum()
  assert 0.85 < rate < 1.15


def test_block_noise_is_one_stratified_t_per_block():
  keys = masking.example_keys(0, 0, jnp.arange(64))
  x = jnp.full((64, 32), 7, jnp.int32)
  maskable = jnp.broadcast_to(jnp.arange(32) >= 5, x.shape)  # a 5-token prompt
  noisy, masked, t = (np.asarray(a) for a in _noise(keys, x, maskable, 8, 1e-3))
  t_blocks = t.reshape(64, 4, 8)
  assert np.all(t_blocks == t_blocks[..., :1])  # constant inside a block
  assert t.min() >= 1e-3 and t.max() <= 1.0
  # Stratified per row: the row's 4 blocks fall in the 4 quarters of [0, 1], one each.
  u = (t_blocks[..., 0] - 1e-3) / (1 - 1e-3)
  assert np.all(np.sort(np.floor(u * 4), -1) == np.arange(4))
  # ... and no block always lands in the same quarter (a position-dependent noise level).
  assert len({tuple(np.floor(u[:, j] * 4)) for j in range(4)}) == 4
  assert not masked[:, :5].any() and np.all(noisy[masked] == MASK)
  rate = masked[:, 5:].sum() / (t[:, 5:]).sum()
  assert 0.85 < rate < 1.15  # masked with probability t


def test_block_sft_never_noises_the_prompt_and_reads_the_clean_stream():
  seen = {}

  def ce_fn(tokens_BL, targets_BL, clean_BL=None, **kwargs):
    del kwargs
    seen.update(noisy=tokens_BL, clean=clean_BL)
    return jnp.ones(tokens_BL.shape, jnp.float32)

  tokens = jnp.asarray(np.random.default_rng(2).integers(4, 64, (4, SEQ + 1)), jnp.int32)
  roles = jnp.full(tokens.shape, RESPONSE, jnp.int32).at[:, :6].set(PROMPT)
  objective, sums, noisy, clean = jax.jit(
    lambda tokens, roles: (
      *sft_loss.sft_loss(
        ce_fn,
        tokens,
        roles=roles,
        seed=0,
        step=1,
        micro_index=0,
        example_ids_B=jnp.arange(4),
        mask_id=MASK,
        normalisation='token',
        block_size=BLOCK,
      ),
      seen['noisy'],
      seen['clean'],
    )
  )(tokens, roles)
  noisy, clean = np.asarray(noisy), np.asarray(clean)
  np.testing.assert_array_equal(clean, np.asarray(tokens[:, :-1]))
  masked = noisy == MASK
  assert not masked[:, :6].any() and masked.any()
  assert float(sums['maskable_count']) == 4 * (SEQ - 6)


def test_config_rules_and_flops_of_the_doubled_sequence():
  ok = {'diffusion.objective': 'block', 'model.attention_mask': 'block_causal'}
  config_lib.validate(tiny_test_config(**ok))
  with pytest.raises(config_lib.ConfigError, match='attention_mask=block_causal'):
    config_lib.validate(tiny_test_config(**{'diffusion.objective': 'block'}))
  with pytest.raises(config_lib.ConfigError, match='shift_logits=false'):
    config_lib.validate(tiny_test_config(**ok, **{'model.shift_logits': True}))
  with pytest.raises(config_lib.ConfigError, match='block_size'):
    config_lib.validate(tiny_test_config(**ok, **{'model.block_size': 5}))
  with pytest.raises(config_lib.ConfigError, match='cudnn'):
    config_lib.validate(tiny_test_config(**ok, **{'model.attention_backend': 'cudnn'}))
  config = tiny_test_config(**ok)
  cfg = model_lib.ModelConfig.from_config(config)
  assert config_lib.attention_streams(config) == 2
  head = cfg.vocab_size * cfg.d_model
  layers = cfg.num_params() - 2 * head  # untied: embedding and head
  attention = 12 * cfg.num_layers * cfg.seq_len * cfg.num_heads * cfg.head_dim
  assert cfg.flops_per_token() == 6 * (layers + head) + attention
  assert cfg.flops_per_token(2) == 6 * (2 * layers + head) + 4 * attention
