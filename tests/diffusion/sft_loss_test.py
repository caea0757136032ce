"""LLaDA's SFT loss against a hand-written numpy statement of every variant, on random rows."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax.data.roles import PADDING, PROMPT, RESPONSE
from dlmjax.diffusion import masking
from dlmjax.diffusion import sft_loss

MASK, EOS, SEED, STEP = 3, 2, 7, 5


def random_rows(rng, batch, width, packed):
  """tokens, roles, segment ids [batch, width] of random conversations (EOS-padded tails)."""
  tokens = np.full((batch, width), EOS, np.int32)
  roles = np.full((batch, width), PADDING, np.int32)
  segments = np.zeros((batch, width), np.int32)
  for b in range(batch):
    start, segment = 0, 1
    while True:
      prompt, response = rng.integers(1, 6), rng.integers(1, 6)
      if start + prompt + response > width - 1 - rng.integers(0, 4) or (segment > 1 and not packed):
        break
      tokens[b, start : start + prompt + response] = rng.integers(4, 50, prompt + response)
      roles[b, start : start + prompt] = PROMPT
      roles[b, start + prompt : start + prompt + response] = RESPONSE
      tokens[b, start + prompt + response - 1] = EOS  # the answer's own EOS is a response token
      segments[b, start : start + prompt + response] = segment
      start, segment = start + prompt + response, segment + 1
    if not packed:
      segments[b] = 1
  return tokens, roles, segments


def numpy_sft_loss(
  ce, masked, p, roles, segments, *, normalisation, supervise_padding, weight, ends=None
):
  """LLaDA GUIDELINES.md's loss written out: per conversation, sum the masked tokens' CE (over p
  when weighted); `sequence` divides each by its answer length and averages over conversations,
  `token` divides the total by all answer tokens, `batch` averages over conversations. ends:
  each row's canvas end (the row cut there), None for whole rows."""
  total, conversations, answer_tokens = 0.0, 0, 0
  batch, length = ce.shape
  for b in range(batch):
    for conversation in sorted(set(segments[b])):
      answer = [
        i
        for i in range(length if ends is None else ends[b])
        if segments[b, i] == conversation
        and (roles[b, i] == RESPONSE or (roles[b, i] == PADDING and supervise_padding))
      ]
      if not answer:
        continue
      conversations += 1
      answer_tokens += len(answer)
      loss = sum(ce[b, i] / (p[b, i] if weight else 1.0) for i in answer if masked[b, i])
      total += loss / len(answer) if normalisation == 'sequence' else loss
  return total / (answer_tokens if normalisation == 'token' else conversations)


@functools.lru_cache(maxsize=None)
def compiled_losses(packed, supervise_padding, time_eps, batch, width):
  """One compilation computing every (normalisation, 1/p weight) variant for a fake model whose
  CE is random, plus the forward process alone with the same keys (the masks and p it used)."""
  ce = np.random.default_rng(1).uniform(0.1, 5.0, (batch, width - 1)).astype(np.float32)
  ids = np.arange(batch) + 100

  @jax.jit
  def fn(tokens, roles, segments):
    out = {}
    for normalisation, weight in itertools.product(NORMALISATIONS, (True, False)):
      seen = {}

      def ce_fn(noisy_BL, targets_BL, seen=seen, **model_kwargs):
        seen.update(noisy=noisy_BL, targets=targets_BL, **model_kwargs)
        return jnp.asarray(ce)

      objective, sums = sft_loss.sft_loss(
        ce_fn,
        tokens,
        roles=roles,
        seed=SEED,
        step=STEP,
        micro_index=0,
        example_ids_B=ids,
        mask_id=MASK,
        segment_ids=segments if packed else None,
        normalisation=normalisation,
        supervise_padding=supervise_padding,
        weight_by_inverse_t=weight,
        time_eps=time_eps,
      )
      out[f'{normalisation}-{weight}'] = (objective, sums, seen)
    x, r = tokens[:, :-1], roles[:, :-1]
    maskable = (r == RESPONSE) | ((r == PADDING) & supervise_padding)
    if supervise_padding and not packed:  # the rows' random canvas ends (checked by the tests)
      maskable = maskable & sft_loss.random_canvas_ends(masking.example_keys(SEED, STEP, ids), r)[1]
    segs = (
      jnp.where((r == PADDING) & (not supervise_padding), 0, segments[:, :-1])
      if packed
      else jnp.ones_like(x)
    )
    _, masked, p = sft_loss.forward_process(
      masking.example_keys(SEED, STEP, ids), x, maskable, segs, mask_id=MASK, time_eps=time_eps
    )
    return out, masked, p, segs

  return fn, ce


def run_loss(
  tokens,
  roles,
  segments,
  packed,
  *,
  normalisation,
  supervise_padding,
  weight_by_inverse_t,
  time_eps,
):
  """(objective, sums, what the model saw, CE, masked, p, segments the loss used)."""
  fn, ce = compiled_losses(packed, supervise_padding, time_eps, *tokens.shape)
  out, masked, p, segs = jax.device_get(fn(tokens, roles, segments))
  objective, sums, seen = out[f'{normalisation}-{weight_by_inverse_t}']
  return float(objective), sums, seen, ce, masked, p, segs


NORMALISATIONS = ('sequence', 'token', 'batch')
VARIANTS = list(itertools.product(NORMALISATIONS, (True, False), (True, False)))


@pytest.mark.parametrize('normalisation,supervise_padding,weight', VARIANTS)
def test_padded_rows_match_numpy(normalisation, supervise_padding, weight):
  rng = np.random.default_rng(0)
  tokens, roles, segments = random_rows(rng, batch=6, width=25, packed=False)
  switches = dict(
    normalisation=normalisation,
    supervise_padding=supervise_padding,
    weight_by_inverse_t=weight,
    time_eps=1e-3,
  )
  objective, sums, seen, ce, masked, p, segs = run_loss(tokens, roles, segments, False, **switches)
  r = roles[:, :-1]
  expected = numpy_sft_loss(
    ce,
    masked,
    p,
    r,
    segs,
    normalisation=normalisation,
    supervise_padding=supervise_padding,
    weight=weight,
    ends=seen['valid_length_B'],
  )
  np.testing.assert_allclose(objective, expected, rtol=1e-5)
  np.testing.assert_allclose(float(sums['loss_num'] / sums['loss_den']), expected, rtol=1e-5)
  # The prompt is never noised; the model sees exactly the masked tokens as MASK.
  assert not (masked & (r == PROMPT)).any()
  np.testing.assert_array_equal(seen['noisy'], np.where(masked, MASK, tokens[:, :-1]))
  np.testing.assert_array_equal(seen['targets'], tokens[:, :-1])
  ends, answered = seen['valid_length_B'], (r != PADDING).sum(1)
  if supervise_padding:  # padding is seen and trained up to each row's random canvas end.
    assert (masked & (r == PADDING)).any() and (ends > answered).any()
    assert (ends >= answered).all() and (ends <= r.shape[1]).all() and len(set(ends)) > 1
    assert not (masked & (np.arange(r.shape[1]) >= ends[:, None])).any()
    np.testing.assert_allclose(sums['conversations'], 6, rtol=1e-5)
  else:  # unsupervised padding is invisible: attention stops at the answer's EOS.
    np.testing.assert_array_equal(seen['valid_length_B'], (r != PADDING).sum(1))
    assert not (masked & (r == PADDING)).any()


@pytest.mark.parametrize(
  'normalisation,weight', list(itertools.product(NORMALISATIONS, (True, False)))
)
def test_packed_rows_match_numpy(normalisation, weight):
  rng = np.random.default_rng(3)
  tokens, roles, segments = random_rows(rng, batch=4, width=33, packed=True)
  assert segments.max() >= 3
  switches = dict(
    normalisation=normalisation, supervise_padding=False, weight_by_inverse_t=weight, time_eps=0.0
  )
  objective, sums, seen, ce, masked, p, segs = run_loss(tokens, roles, segments, True, **switches)
  expected = numpy_sft_loss(
    ce,
    masked,
    p,
    roles[:, :-1],
    segs,
    normalisation=normalisation,
    supervise_padding=False,
    weight=weight,
  )
  np.testing.assert_allclose(objective, expected, rtol=1e-5)
  conversations = sum(len(set(row[row > 0])) for row in segs)
  np.testing.assert_allclose(sums['conversations'], conversations, rtol=1e-5)
  # Attention and positions stay inside each conversation; padding is a segment of its own.
  np.testing.assert_array_equal(seen['segment_ids_BL'], segs)
  first = seen['positions_BL'][segs != np.roll(segs, 1, axis=1)]
  assert (first == 0).all()
  # One t per conversation: p is constant within a conversation and differs between them.
  for b in range(segs.shape[0]):
    per_conversation = {s: np.unique(p[b][segs[b] == s]) for s in set(segs[b]) if s}
    assert all(len(v) == 1 for v in per_conversation.values())
    assert len({float(v[0]) for v in per_conversation.values()}) == len(per_conversation)


def test_masking_rate_is_p_and_p_is_lladas():
  """Each maskable token is masked with probability p = (1 - eps) t + eps; nothing else is."""
  eps = 0.25
  batch, length = 512, 40
  rng = np.random.default_rng(0)
  maskable = rng.random((batch, length)) < 0.7
  keys = masking.example_keys(0, 0, np.arange(batch))
  _, masked, p = jax.jit(
    lambda k, m: sft_loss.forward_process(
      k,
      jnp.full((batch, length), 9),
      m,
      jnp.ones((batch, length), jnp.int32),
      mask_id=MASK,
      time_eps=eps,
    )
  )(keys, maskable)
  masked, p = np.asarray(masked), np.asarray(p)
  assert not (masked & ~maskable).any()
  assert p.min() >= eps and p.max() <= 1.0
  np.testing.assert_array_equal(p, np.repeat(p[:, :1], length, axis=1))  # one t per row
  expected = (p * maskable).sum()
  std = np.sqrt((p * (1 - p) * maskable).sum())
  assert abs(masked.sum() - expected) < 4 * std
  # t is uniform: its mean is 1/2 (std of the mean of 512 draws ~ 0.013).
  t = (p[:, 0] - eps) / (1 - eps)
  assert abs(t.mean() - 0.5) < 0.06


def test_canvas_ends_are_uniform_from_the_answer_to_the_row_end():
  """Every end from the answer's EOS to the full row is drawn, evenly, apart from t: the model
  sees canvases of every length the decode may give it (prompt + gen_length)."""
  batch, length = 4000, 12
  roles = np.full((batch, length), PADDING, np.int32)
  answered = np.arange(batch) % 5 + 3  # 3 .. 7 tokens of prompt and answer
  roles[np.arange(length) < answered[:, None]] = RESPONSE
  keys = masking.example_keys(SEED, STEP, np.arange(batch))
  ends, kept = jax.device_get(jax.jit(sft_loss.random_canvas_ends)(keys, roles))
  np.testing.assert_array_equal(kept, np.arange(length) < ends[:, None])
  for n in range(3, 8):
    counts = np.bincount(ends[answered == n] - n, minlength=length + 1 - n)
    assert len(counts) == length + 1 - n and counts.min() > 0.6 * counts.mean()
  _, _, p = sft_loss.forward_process(
    keys,
    jnp.zeros((batch, length), jnp.int32),
    jnp.asarray(roles == RESPONSE),
    jnp.ones((batch, length), jnp.int32),
    mask_id=MASK,
    time_eps=0.0,
  )
  assert abs(np.corrcoef(ends - answered, np.asarray(p)[:, 0])[0, 1]) < 0.06


def test_unknown_normalisation_is_refused():
  with pytest.raises(ValueError, match='normalisation'):
    sft_loss.sft_loss(
      None,
      jnp.zeros((1, 3), jnp.int32),
      roles=jnp.zeros((1, 3), jnp.int32),
      seed=0,
      step=0,
      micro_index=0,
      example_ids_B=np.arange(1),
      mask_id=3,
      normalisation='row',
    )
