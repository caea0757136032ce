"""wd1++ (wd1 paper v2, section 3.3, Eq. 10): its expanded-group weights and loss against a
numpy statement of the equation on hand numbers, and one update's direction."""

import jax
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl import estimators, objectives
from dlmjax.rl.objectives import wd1pp
from dlmjax.train.stages import rl as rl_stage
from tests.conftest import tiny_test_config
from tests.rl import compiled

MASK, EOS, PAD = 3, 2, 0


def _eq9_weights(rewards_GS, psi):
  """Eq. 9 over one prompt's expanded group, written out item by item."""
  items = [r for row in rewards_GS for r in row]
  mean = sum(items) / len(items)
  a = [psi * (r - mean) for r in items]
  plus = [np.exp(x) / sum(np.exp(y) for y in a) for x in a]
  minus = [np.exp(-x) / sum(np.exp(-y) for y in a) for x in a]
  return np.array([p - m for p, m in zip(plus, minus)]).reshape(np.shape(rewards_GS))


def test_weights_are_softmaxes_over_the_expanded_group():
  rewards = np.array([[0, 0, 1], [0, 1, 1], [0.5, 0, 0], [2, 0, 1]], np.float32)  # 2 prompts
  for psi in (1.0, 2.5):
    got = advantages_lib.wd1pp_weights(rewards, 2, psi)
    want = np.concatenate([_eq9_weights(rewards[:2], psi), _eq9_weights(rewards[2:], psi)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got.reshape(2, -1).sum(1), 0.0, atol=1e-6)
  assert (advantages_lib.wd1pp_weights(np.ones((4, 3)), 2) == 0).all()  # equal rewards: no push


def _trajectory(rng, rows, prompt_width, gen, vocab):
  """A consistent trajectory: commit steps a permutation per row (one token a step), the final
  tokens, and each step's prediction (committed tokens kept, the rest random, some EOS)."""
  steps = np.stack([rng.permutation(gen) for _ in range(rows)]).astype(np.int32)
  preds = rng.integers(4, vocab, (rows, gen, gen)).astype(np.int32)
  preds[rng.random(preds.shape) < 0.15] = EOS
  final = preds[np.arange(rows)[:, None], steps, np.arange(gen)[None]]  # its step's prediction
  for l in range(gen):  # noqa: E741  the paper's step index; committed tokens stay
    preds[:, l] = np.where(steps < l, final, preds[:, l])
  lengths = rng.integers(2, prompt_width + 1, rows).astype(np.int32)
  prompt = np.full((rows, prompt_width), PAD, np.int32)
  for b, n in enumerate(lengths):
    prompt[b, prompt_width - n :] = rng.integers(4, vocab, n)
  return prompt, lengths, preds, steps


@pytest.mark.parametrize('dce_weight', [True, False])
def test_loss_equals_eq10_written_out(dce_weight):
  group, prompt_width, gen, vocab = 2, 3, 4, 40
  c = tiny_test_config(
    **{
      'rl.objective': 'wd1pp',
      'rl.kl_beta': 0.0,
      'rl.group_size': group,
      'rl.wd1pp_dce_weight': dce_weight,
      'model.vocab_size': vocab,
      'model.seq_len': 8,
      'model.init_std': 0.3,
    }
  )
  rng = np.random.default_rng(0)
  rows = 4
  prompt, prompt_lengths, preds, steps_BG = _trajectory(rng, rows, prompt_width, gen, vocab)
  rewards = rng.integers(0, 3, (rows, gen)).astype(np.float32)
  weights = advantages_lib.wd1pp_weights(rewards, group, 1.0)
  draws = wd1pp.stepwise_draws(0, np.arange(rows), gen)
  batch = wd1pp.stepwise_rows(
    prompt,
    prompt_lengths,
    preds,
    steps_BG,
    weights,
    draws,
    group_size=group,
    mask_id=MASK,
    eos_id=EOS,
    pad_id=PAD,
    dce_weight=dce_weight,
  )
  model_config = model_lib.ModelConfig.from_config(c)
  params = model_lib.init_params(model_config, jax.random.key(0))
  module = model_lib.merge(model_config, params)
  width = prompt_width + gen
  zeros = np.zeros(rows, np.float32)
  loss, _ = jax.jit(rl_stage.make_loss(c))(
    module,
    prompt_lengths=prompt_lengths,
    mask_seeds=np.arange(rows, dtype=np.int32),
    old=zeros,
    ref=zeros,
    rewards=rewards[:, -1],
    **batch,
  )
  # Eq. 10 by hand: per prompt (L / G) sum_i f_i (-w+ + w-)(x_0|l_i) log pi(x_0|l_i | x_l_i),
  # f_i = 1 / t_i (the masked share of x_l_i's canvas) or 1; the prompts averaged.
  logits = np.asarray(module(batch['tokens'], valid_length_B=batch['lengths']), np.float64)
  logits = logits[..., :vocab]  # the embedding's padded rows are no tokens: out of the softmax
  logsm = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  per_prompt = np.zeros(rows // group)
  for b in range(rows):
    p, l = int(prompt_lengths[b]), int(draws[b])  # noqa: E741
    x0 = preds[b, l]
    end = int(np.flatnonzero(x0 == EOS)[0]) + 1 if (x0 == EOS).any() else gen
    masked = [k for k in range(gen) if steps_BG[b, k] >= l]  # the state before step l + 1
    for k in range(gen):  # x_l: committed tokens, MASK elsewhere
      assert batch['tokens'][b, p + k] == (MASK if k in masked else x0[k])
    logp = sum(logsm[b, p + k, x0[k]] for k in masked if k < end)
    f = gen / len(masked) if dce_weight else 1.0
    per_prompt[b // group] += gen / group * f * -weights[b, l] * logp
  assert batch['tokens'].shape == (rows, width)
  np.testing.assert_allclose(float(loss), per_prompt.mean(), rtol=1e-4)


def test_objective_line_states_the_factor():
  for dce, text in [(True, 'L / G x 1 / t_l'), (False, 'L / G (rl.wd1pp_dce_weight=False')]:
    c = tiny_test_config(**{'rl.objective': 'wd1pp', 'rl.kl_beta': 0.0, 'rl.wd1pp_dce_weight': dce})
    line = objectives.describe(c)
    assert line.startswith('rl.objective=wd1pp: ') and '\n' not in line and text in line


def test_one_step_moves_logprobs_toward_positive_weights():
  # 4 groups of 2 over 2 micro-batches; each row a drawn step of its own trajectory.
  c, setup, step_fn, _ = compiled.rl_step('wd1pp')
  state = setup.init_state(0)
  rng = np.random.default_rng(0)
  rows, gen, steps = compiled.ROWS, compiled.GEN, c.sampler.steps
  prompt, prompt_lengths, preds, _ = _trajectory(
    rng, rows, compiled.PROMPT, gen, c.model.vocab_size
  )
  steps_BG = (np.stack([rng.permutation(gen) for _ in range(rows)]) % steps).astype(np.int32)
  weights = np.tile(np.array([[0.5], [-0.5], [-0.5], [0.5]] * 2, np.float32), (1, steps))
  batch = wd1pp.stepwise_rows(
    prompt,
    prompt_lengths,
    preds[:, :steps],
    steps_BG,
    weights,
    wd1pp.stepwise_draws(c.seed, np.arange(rows), steps),
    group_size=2,
    mask_id=c.model.mask_token_id,
    eos_id=c.model.eos_token_id,
    pad_id=c.model.pad_token_id,
  )
  # the canvas is the model's width: pads after each row
  pad = c.model.seq_len - batch['tokens'].shape[1]
  batch = {
    k: np.pad(
      v, ((0, 0), (0, pad)), constant_values=c.model.pad_token_id if k != 'completion_mask' else 0
    )
    if v.ndim == 2
    else v
    for k, v in batch.items()
  }

  @jax.jit
  def logp(params):
    module = model_lib.merge(setup.model_config, params)
    return estimators.stepwise_logprobs(
      module,
      batch['tokens'],
      batch['targets'],
      batch['completion_mask'],
      batch['lengths'],
      mask_id=c.model.mask_token_id,
    )

  before = np.asarray(logp(state['params']))
  zeros = np.zeros(rows, np.float32)
  full = dict(
    batch,
    prompt_lengths=prompt_lengths,
    mask_seeds=np.arange(rows, dtype=np.int32),
    old=zeros,
    ref=zeros,
    rewards=zeros,
  )
  state, _ = step_fn(state, {k: jax.device_put(v, step_fn.batch_sharding) for k, v in full.items()})
  change = np.asarray(logp(state['params'])) - before
  gain = (change * np.sign(batch['advantages'])).reshape(4, 2).sum(1)
  assert (gain > 0).all(), gain


@pytest.mark.parametrize(
  'setting, fix',
  [
    ({'sampler.cache': 'prefix'}, 'set --config.sampler.cache=none'),
    ({'sampler.threshold': 0.9}, 'sampler.threshold=0'),
    ({'rl.kl_beta': 0.04}, 'rl.kl_beta=0'),
  ],
)
def test_config_refuses_what_wd1pp_cannot_read(setting, fix):
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  base = {
    'stage': 'rl',
    'init_from': 'x',
    'rl.objective': 'wd1pp',
    'rl.kl_beta': 0.0,
    'rl.max_prompt_tokens': 16,
    'sampler.gen_length': 16,
    'sampler.block_length': 16,
    'sampler.steps': 4,
  }
  config_lib.validate(tiny_test_config(**base), num_devices=1)
  with pytest.raises(config_lib.ConfigError, match=fix.replace('.', r'\.')):
    config_lib.validate(tiny_test_config(**{**base, **setting}), num_devices=1)
