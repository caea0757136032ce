"""The commit rule (diffusion/decoding.py) against hand-written statements of Dream's orders,
Fast-dLLM's factor rule, Dream's alg_temp draw and the per-row EOS exit."""

import dataclasses
import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.diffusion import decoding
from dlmjax.diffusion import block_loop, prompt_rows, sampler, sampler_programs, sampling_config
from tests.conftest import tiny_test_config

MASK, EOS, PAD, VOCAB = 3, 2, 0, 100


def _np_softmax(x):
  z = np.exp(x - x.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


def _np_top_p(logits, top_p):
  """Keep the tokens whose strictly more likely tokens hold < top_p of the probability."""
  out = np.full_like(logits, -np.inf)
  for index in np.ndindex(logits.shape[:-1]):
    row = logits[index]
    p = _np_softmax(row)
    kept = [v for v in range(len(row)) if p[row > row[v]].sum() < top_p]
    out[index][kept] = row[kept]
  return out


def _np_confidence(logits, x0, order, temperature, top_p):
  """Dream's sample_tokens (maskgit_plus, topk_margin, entropy) and LLaDA's low_confidence."""
  if order == 'low_confidence':
    return np.take_along_axis(_np_softmax(logits), x0[..., None], -1)[..., 0]
  filtered = _np_top_p(logits, top_p) if top_p < 1 else logits
  p = _np_softmax(filtered / temperature if temperature > 0 else filtered)
  if order == 'maskgit_plus':
    return np.take_along_axis(p, x0[..., None], -1)[..., 0]
  if order == 'margin':
    ordered = -np.sort(-p, axis=-1)
    return ordered[..., 0] - ordered[..., 1]
  assert order == 'entropy'
  return (p * np.log(p + 1e-10)).sum(-1)


@pytest.mark.parametrize('temperature,top_p', [(0.0, 1.0), (0.8, 0.9)])
@pytest.mark.parametrize('order', ['low_confidence', 'maskgit_plus', 'margin', 'entropy'])
def test_confidence_of_each_order_is_its_formula(order, temperature, top_p):
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 2, (3, 5, 11)).astype(np.float32)
  logits[..., 7] = -np.inf  # a forbidden token (MASK, padded vocabulary rows)
  x0 = decoding.sample_tokens(logits, jax.random.key(1), temperature, top_p)
  got = decoding.confidence(
    logits, x0, order, jax.random.key(2), temperature=temperature, top_p=top_p
  )
  want = _np_confidence(logits.astype(np.float64), np.asarray(x0), order, temperature, top_p)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=1e-6)
  if order == 'maskgit_plus' and temperature == 0:  # Dream's maskgit_plus at T = 0: max p.
    np.testing.assert_allclose(got, _np_softmax(logits.astype(np.float64)).max(-1), rtol=2e-5)


def test_random_order_is_a_seeded_uniform_draw():
  x0 = jnp.zeros((2, 6), jnp.int32)
  conf = decoding.confidence(jnp.zeros((2, 6, 4)), x0, 'random', jax.random.key(5))
  np.testing.assert_array_equal(conf, jax.random.uniform(jax.random.key(5), (2, 6)))


def _factor_plain(conf_row, masked_row, factor):
  """Fast-dLLM's loop: sort the masked confidences; accept the first; accept the n-th while
  c_(n) >= 1 - factor / (n + 1); stop at the first that fails."""
  positions = sorted(np.flatnonzero(masked_row), key=lambda q: (-conf_row[q], q))
  accepted = []
  for n, q in enumerate(positions, start=1):
    if n > 1 and conf_row[q] < 1 - factor / (n + 1):
      break
    accepted.append(q)
  return set(accepted)


@pytest.mark.parametrize('factor', [0.5, 1.0, 2.0])
def test_factor_rule_is_fast_dllms(factor):
  rng = np.random.default_rng(3)
  rows, k = 64, 8
  # Confidences spread over [0.3, 1): most rows accept some of their tokens, some all.
  logits = rng.normal(0, 1, (rows, k, 6)).astype(np.float32)
  logits[..., 0] += rng.uniform(0, 9, (rows, k)).astype(np.float32)
  logits[..., MASK] = -np.inf  # as the sampler's logits: MASK is never predicted
  x_BK = np.where(rng.uniform(size=(rows, k)) < 0.75, MASK, 10).astype(np.int32)
  settings = sampling_config.SamplingConfig(factor=factor)
  got = decoding.commit_step(
    logits,
    x_BK,
    np.zeros(rows, np.int32),  # no scheduled tokens: only the factor rule commits
    block_loop.step_keys(jax.random.key(0), 0, 0),
    settings,
    mask_id=MASK,
  )
  committed = np.asarray(got) != x_BK
  conf = _np_softmax(logits.astype(np.float64)).max(-1)
  sizes = []
  for b in range(rows):
    want = _factor_plain(conf[b], x_BK[b] == MASK, factor)
    assert set(np.flatnonzero(committed[b])) == want, b
    sizes.append((len(want), int((x_BK[b] == MASK).sum())))
  assert any(1 < n < m for n, m in sizes) and any(n == m for n, m in sizes)  # not trivial
  np.testing.assert_array_equal(np.asarray(got)[committed], logits.argmax(-1)[committed])


def test_factor_adds_to_the_schedule():
  conf = jnp.array([[0.99, 0.2, 0.98, 0.3, -jnp.inf]])
  # Sorted: 0.99 (n=1, always), 0.98 >= 1 - 1/3 (n=2), 0.3 < 1 - 1/4 (n=3): stop.
  np.testing.assert_array_equal(decoding.factor_accepts(conf, 1.0)[0, :4], [1, 0, 1, 0])


def test_alg_temp_draws_positions_seeded_and_by_softmax():
  conf = jnp.array([0.9, 0.6, -jnp.inf, 0.3, 0.1])  # position 2 is not masked
  alg_temp, rows = 0.25, 40_000
  conf_BK = jnp.tile(conf, (rows, 1))
  draw = jax.jit(decoding.scheduled, static_argnums=3)
  one = np.asarray(draw(conf_BK, jnp.ones(rows, jnp.int32), jax.random.key(0), alg_temp))
  np.testing.assert_array_equal(
    one, draw(conf_BK, jnp.ones(rows, jnp.int32), jax.random.key(0), alg_temp)
  )
  assert (one != draw(conf_BK, jnp.ones(rows, jnp.int32), jax.random.key(1), alg_temp)).any()
  assert (one.sum(1) == 1).all() and not one[:, 2].any()
  weights = np.exp(np.array([0.9, 0.6, 0.0, 0.3, 0.1]) / alg_temp) * [1, 1, 0, 1, 1]
  np.testing.assert_allclose(one.mean(0), weights / weights.sum(), atol=0.01)
  # Two positions: without replacement, as torch.multinomial (the chance of each pair).
  two = np.asarray(draw(conf_BK, jnp.full(rows, 2, jnp.int32), jax.random.key(2), alg_temp))
  p = weights / weights.sum()
  for i, j in itertools.combinations([0, 1, 3, 4], 2):
    pair = p[i] * p[j] / (1 - p[i]) + p[j] * p[i] / (1 - p[j])
    assert abs((two[:, i] & two[:, j]).mean() - pair) < 0.01, (i, j)
  # alg_temp 0 is the top-k.
  np.testing.assert_array_equal(
    decoding.scheduled(conf[None], jnp.array([2]), jax.random.key(0))[0], [1, 1, 0, 0, 0]
  )


def test_finished_rows():
  x = np.array(
    [
      [7, 5, EOS, MASK],  # EOS with nothing masked before it: final
      [7, MASK, EOS, 5],  # a mask before the EOS may still become an earlier EOS
      [7, 5, 6, MASK],  # no EOS
      [7, EOS, 5, 6],  # prompt tokens are not the completion: its EOS counts
      [EOS, 5, 6, 8],  # an EOS in the prompt (width 1) does not
    ]
  )
  got = decoding.finished_rows(x, 1, mask_id=MASK, eos_id=EOS)
  np.testing.assert_array_equal(got, [True, False, False, True, False])


class _TableModel:
  """A stand-in model whose logits are a fixed table [B, L, V], counting its forwards."""

  def __init__(self, table):
    self.table, self.forwards = jnp.asarray(table), 0
    batch, length, vocab = table.shape
    self.cfg = types.SimpleNamespace(
      seq_len=length, attention_mask='bidirectional', block_size=1, vocab_size=vocab
    )

  def _count(self):
    self.forwards += 1

  def hidden(self, tokens, segment_ids_BL, positions_BL):
    del segment_ids_BL, positions_BL
    jax.debug.callback(self._count)
    return self.table[:, : tokens.shape[1]] + 0 * tokens[..., None]

  def logits(self, hidden):
    return hidden


def test_rows_stop_at_their_eos_and_the_block_ends_when_all_are_done():
  # 2 rows, prompt width 1, 2 blocks of 8, one token per step. Row 0 predicts EOS at completion
  # position 2, row 1 at 5, most confidently, then positions left to right: row 0's text is
  # final after 3 steps, row 1's after 6, so the first block takes 6 forwards and the second none.
  width, gen, vocab = 1, 16, 40
  table = np.zeros((2, width + gen, vocab), np.float32)
  for row, eos_at in enumerate((2, 5)):
    for j in range(gen):
      table[row, width + j, 10 + j] = 8.0 - 0.3 * j
    table[row, width + eos_at, :] = 0.0
    table[row, width + eos_at, EOS] = 9.0
  s = sampling_config.SamplingConfig(gen_length=gen, steps=gen, block_length=8)
  prompt_BP, lengths = np.array([[5], [6]], np.int32), np.array([1, 1], np.int32)

  def run(settings):
    module = _TableModel(table)
    out = sampler.generate(
      module, prompt_BP, lengths, settings, jax.random.key(0), mask_id=MASK, eos_id=EOS, pad_id=PAD
    )
    jax.effects_barrier()
    return np.asarray(out), module.forwards

  plain, plain_forwards = run(s)
  fast, fast_forwards = run(dataclasses.replace(s, stop_at_eos=True))
  assert (plain_forwards, fast_forwards) == (16, 6)
  assert prompt_rows.completions(fast, width, EOS) == prompt_rows.completions(plain, width, EOS)
  assert prompt_rows.completions(plain, width, EOS) == [[10, 11], [10, 11, 12, 13, 14]]
  assert (fast[0, width + 3 :] == EOS).all()  # row 0 froze: its masks read as EOS


@pytest.fixture(scope='module')
def tiny():
  config = tiny_test_config(**{'model.vocab_size': VOCAB, 'model.init_std': 0.3})
  model_config = model_lib.ModelConfig.from_config(config)
  return model_config, model_lib.init_params(model_config, jax.random.key(0))


PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [20], [30, 31, 32, 33, 34, 35]]


def test_per_row_exit_keeps_the_text_of_a_real_model(tiny):
  """Sampled decoding with Dream's margin order and the factor rule: freezing rows at their EOS
  changes no completion text, for the plain run's 2 most common tokens as EOS."""
  model_config, params = tiny
  s = sampling_config.SamplingConfig(
    gen_length=16, steps=16, block_length=8, temperature=0.7, remasking='margin', factor=1.0
  )
  prompt_BP, lengths = prompt_rows.pad_prompts(PROMPTS, PAD)

  def run(settings, eos_id):
    fn = sampler_programs.make_generate_fn(
      model_config, settings, mask_id=MASK, eos_id=eos_id, pad_id=PAD, vocab_size=VOCAB
    )
    return np.asarray(fn(params, prompt_BP, lengths, jax.random.key(4)))

  plain = run(s, EOS)  # eos_id is not read without stop_at_eos
  values, counts = np.unique(plain[:, 6:], return_counts=True)
  froze = False
  for eos in values[np.argsort(-counts)][:2]:
    fast = run(dataclasses.replace(s, stop_at_eos=True), int(eos))
    assert prompt_rows.completions(fast, 6, eos) == prompt_rows.completions(plain, 6, eos)
    froze |= bool((fast != plain).any())
  assert froze  # some row stopped at its EOS while the plain run kept decoding it


def test_entropy_threshold_is_dparallels_rule():
  """remasking=entropy with one scheduled token and entropy_threshold h: dParallel's
  get_transfer_index_entropy, written out: the lowest-entropy masked token, plus every masked
  token with H = -sum p log(p + 1e-12) <= h (fp64 softmax)."""
  rng = np.random.default_rng(5)
  rows, k = 32, 8
  logits = rng.normal(0, 1, (rows, k, 6)).astype(np.float32)
  logits[..., 0] += rng.uniform(0, 9, (rows, k)).astype(np.float32)
  logits[..., MASK] = -np.inf
  x_BK = np.where(rng.uniform(size=(rows, k)) < 0.75, MASK, 10).astype(np.int32)
  settings = sampling_config.SamplingConfig(remasking='entropy', entropy_threshold=0.5)
  got = decoding.commit_step(
    logits,
    x_BK,
    np.ones(rows, np.int32),
    block_loop.step_keys(jax.random.key(0), 0, 0),
    settings,
    mask_id=MASK,
  )
  committed = np.asarray(got) != x_BK
  p = _np_softmax(logits.astype(np.float64))
  h = -(p * np.log(p + 1e-12)).sum(-1)
  sizes = []
  for b in range(rows):
    masked = np.flatnonzero(x_BK[b] == MASK)
    if not len(masked):
      continue
    want = {masked[np.argmin(h[b, masked])]} | {i for i in masked if h[b, i] <= 0.5}
    assert set(np.flatnonzero(committed[b])) == want, b
    sizes.append(len(want))
  assert min(sizes) == 1 and max(sizes) > 2  # not trivial
