"""One RL step through the shared train step moves likelihood toward positive advantages.

The loss path (micro-batch split, loss weights, clipped surrogate) must pair each row with its
own advantage. The check is made from outside that path: each row's likelihood estimate (d1's
token log-probs via the rollout scorer, also summed for wd1; coupled-GRPO's coupled token estimate;
SPG's bounds), before and after one AdamW step, must move
the advantage-signed sum of every group up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlmjax import model as model_lib
from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl import estimators, objectives
from tests.rl import compiled

PROMPT, GEN = compiled.PROMPT, compiled.GEN


@pytest.mark.parametrize('objective', ['d1', 'spg', 'wd1', 'coupled_grpo', 'trace'])
def test_one_step_moves_logprobs_toward_positive_advantages(objective):
  # 4 groups of 2 over 2 micro-batches (strided rows): a row/advantage mix-up would show. d1's
  # step also has its KL term (reference = old policy here, so no KL gradient at this step).
  c, setup, step_fn, score = compiled.rl_step(objective)
  state = setup.init_state(0)
  rng = np.random.default_rng(0)
  rows, width = 8, c.model.seq_len
  tokens = rng.integers(4, c.model.vocab_size, size=(rows, width)).astype(np.int32)
  tokens[1::2, :PROMPT] = tokens[0::2, :PROMPT]  # the two rows of a group share the prompt
  tokens[:, PROMPT + GEN :] = c.model.pad_token_id
  prompt_lengths = np.full(rows, PROMPT, np.int32)
  lengths = np.full(rows, PROMPT + GEN, np.int32)
  seeds = np.arange(rows, dtype=np.int32)
  advantages = np.array([1, -1, -1, 1, 1, -1, -1, 1], np.float32) * 0.5
  completion = np.zeros((rows, width), np.float32)
  completion[:, PROMPT : PROMPT + GEN] = 1.0
  token_level = objective in ('d1', 'coupled_grpo', 'trace')
  # TraceRL's trajectory: blocks of 4 from position 0, two commit steps each (in random order).
  position = np.arange(width)[None]
  in_completion = (position >= PROMPT) & (position < PROMPT + GEN)
  steps = np.where(in_completion, position // 4 * 2 + rng.integers(0, 2, (rows, width)), -1)
  trajectory = dict(steps=steps.astype(np.int32)) if objective == 'trace' else {}

  @jax.jit
  def spg_bound(params):  # the bound each row's SPG term uses: ELBO if A > 0, else the mixture
    elbo, eubo = estimators.spg_sequence_bounds(
      model_lib.merge(setup.model_config, params),
      tokens,
      prompt_lengths,
      lengths,
      completion,
      seeds,
      seed=c.seed,
      mask_id=c.model.mask_token_id,
      num_samples=c.rl.elbo_samples,
      block_length=GEN,
      p_mask_prompt=c.rl.p_mask_prompt,
      eubo_beta=c.rl.spg_eubo_beta,
    )
    w = c.rl.spg_mix_weight
    return jnp.where(advantages > 0, elbo, w * eubo + (1 - w) * elbo)

  def estimate(params):  # the objective's own per-row log-likelihood estimate
    if objective == 'spg':
      return np.asarray(spg_bound(params))
    logp = np.asarray(score(params, tokens, prompt_lengths, lengths, seeds, **trajectory))
    return (logp * completion).sum(1) / completion.sum(1)

  before = estimate(state['params'])
  old = (
    np.asarray(score(state['params'], tokens, prompt_lengths, lengths, seeds, **trajectory))
    if token_level
    else np.zeros(rows, np.float32)
  )
  batch = dict(
    tokens=tokens,
    prompt_lengths=prompt_lengths,
    lengths=lengths,
    mask_seeds=seeds,
    # wd1's rows carry its weights softmax(A) - softmax(-A) (its objective's advantages)
    advantages=advantages_lib.wd1_weights(advantages, 2) if objective == 'wd1' else advantages,
    old=old,
    ref=old,
    completion_mask=completion,
    weight=objectives.get(objective).loss_weights(completion, group_size=2),
    rewards=advantages,
    **trajectory,
  )
  state, metrics = step_fn(
    state, {k: jax.device_put(v, step_fn.batch_sharding) for k, v in batch.items()}
  )
  assert float(metrics['clip_fraction']) == 0.0  # ratio 1 at the first update
  change = estimate(state['params']) - before
  # Each group's A>0 row gains log-probability on its A<0 row.
  gain = (change * np.sign(advantages)).reshape(4, 2).sum(1)
  assert (gain > 0).all(), gain
