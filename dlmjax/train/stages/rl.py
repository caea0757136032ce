"""RL from verifiable rewards: rollouts of the current policy; diffu-GRPO (d1), ESPO, SPG, wd1,
wd1++, coupled-GRPO or TraceRL loss.

The batch source (dlmjax/rl/rollout.py) generates G completions per prompt with the params of the
step about to run, scores them, and serves the same rollouts rl.inner_updates times, each with its
own mask seed and the old / reference estimates for it, computed once after generation.
"""

from __future__ import annotations

import functools
import json
import os

import jax.numpy as jnp
import numpy as np

from dlmjax import tasks as tasks_lib
from dlmjax.data import run_tokenizer
from dlmjax.tasks import code as code_tasks
from dlmjax.tasks import code_exec
from dlmjax.rl import estimators, objectives
from dlmjax.rl import evaluation as rl_evaluation
from dlmjax.rl import prompts as prompts_lib
from dlmjax.rl import rollout as rollout_lib
from dlmjax.train.stages import base


def make_loss(config):
  """loss(module, tokens=, prompt_lengths=, lengths=, ...) -> (objective, sums).

  `weight` holds each unit's share of the GLOBAL batch average (rollout.loss_weights), so each
  micro-batch's weighted sum is its share of the step's loss, as the step's rule wants.
  """
  r = config.rl
  common = dict(
    seed=config.seed, mask_id=config.model.mask_token_id, chunk_size=config.model.loss_chunk_tokens
  )
  beta = r.kl_beta

  def fn(
    module,
    *,
    tokens,
    prompt_lengths,
    lengths,
    mask_seeds,
    advantages,
    old,
    ref,
    weight,
    completion_mask,
    rewards,
    steps=None,
    targets=None,
    step=None,
    micro_index=None,
    example_ids_B=None,
  ):
    del step, micro_index, example_ids_B  # randomness comes from the rollout's mask seeds
    if r.objective in ('d1', 'coupled_grpo', 'wd1', 'trace'):
      if r.objective == 'trace':  # the rollout's trajectory: each token's commit step
        logp = rollout_lib.trace_logprobs(config, module, tokens, prompt_lengths, lengths, steps)
      else:
        logp = estimators.token_estimator(r.objective)(
          module,
          tokens,
          prompt_lengths,
          lengths,
          mask_seeds,
          p_mask_prompt=r.p_mask_prompt,
          **common,
        )
      if r.objective == 'wd1':  # advantages holds wd1's weights (rollout.row_advantages)
        loss = objectives.wd1_sequence_loss(jnp.sum(logp * completion_mask, axis=1), advantages)
        kl = clipped = jnp.zeros_like(loss)  # wd1 has neither a ratio nor a KL term
      else:
        loss, kl, clipped = objectives.d1_token_loss(
          logp, old, ref, advantages, eps=r.clip_eps, beta=beta
        )
    elif r.objective == 'wd1pp':  # tokens: a drawn step's state x_l, targets: its x_0|l
      logp = estimators.stepwise_logprobs(
        module,
        tokens,
        targets,
        completion_mask,
        lengths,
        mask_id=common['mask_id'],
        chunk_size=common['chunk_size'],
      )
      loss = objectives.wd1_sequence_loss(logp, advantages)  # advantages: w+ - w- of x_0|l
      kl = clipped = jnp.zeros_like(loss)  # no ratio, no KL term (the paper's beta = 0)
    elif r.objective == 'spg':
      elbo, eubo = estimators.spg_sequence_bounds(
        module,
        tokens,
        prompt_lengths,
        lengths,
        completion_mask,
        mask_seeds,
        num_samples=r.elbo_samples,
        block_length=config.sampler.block_length,
        p_mask_prompt=r.p_mask_prompt,
        eubo_beta=r.spg_eubo_beta,
        **common,
      )
      loss = objectives.spg_sequence_loss(elbo, eubo, advantages, mix_weight=r.spg_mix_weight)
      kl = clipped = jnp.zeros_like(loss)  # SPG has neither a ratio nor a KL term
    else:
      elbo = estimators.sequence_elbo(
        module, tokens, prompt_lengths, lengths, mask_seeds, num_samples=r.elbo_samples, **common
      )
      loss, kl, clipped = objectives.espo_sequence_loss(
        elbo,
        old,
        ref,
        advantages,
        (lengths - prompt_lengths).astype(jnp.float32),
        eps=r.clip_eps,
        beta=beta,
      )
    objective = jnp.sum(weight * loss)
    sums = dict(
      loss_sum=objective,
      kl_sum=jnp.sum(weight * kl),
      clip_sum=jnp.sum(weight * clipped.astype(jnp.float32)),
      tokens=jnp.sum(completion_mask),
      rows=jnp.float32(tokens.shape[0]),
      reward_sum=jnp.sum(rewards),
      reward_sq_sum=jnp.sum(jnp.square(rewards)),
    )
    return objective, sums

  return fn


def metrics(sums) -> dict:
  rows = jnp.maximum(sums['rows'], 1.0)
  reward_mean = sums['reward_sum'] / rows
  return dict(
    loss=sums['loss_sum'],
    kl=sums['kl_sum'],
    clip_fraction=sums['clip_sum'],
    tokens=sums['tokens'],
    completion_length=sums['tokens'] / rows,
    reward_mean=reward_mean,
    reward_std=jnp.sqrt(jnp.maximum(sums['reward_sq_sum'] / rows - reward_mean**2, 0.0)),
  )


def make_prompts(config) -> prompts_lib.Prompts:
  task = tasks_lib.get_task(
    config.rl.task, data_path=config.rl.task_data, columns=config.data.columns
  )
  if isinstance(task, code_tasks.CodeTask):
    task.allow_unsandboxed = config.rl.allow_unsandboxed_code
    task.sandbox()  # no boundary and no opt-in: stop before tokenising or generating anything
  return prompts_lib.Prompts(config, task, run_tokenizer.load(config, build=True))


SANDBOX_FILE = 'code_sandbox.json'  # beside config.json: what held the run's programs


def record_sandbox(config, task) -> None:
  """A code task's start-up line, printed and kept in the run directory (code_sandbox.json)."""
  line = task.sandbox()
  print(line, flush=True)
  with open(os.path.join(config.output_dir, SANDBOX_FILE), 'w') as f:
    json.dump(dict(sandbox=line, boundary=code_exec.boundary()[0] is not None), f)


def stage(config) -> base.Stage:
  # Rollouts and the held-out evaluation share one tokenised prompt set, built on first use.
  prompts = functools.cache(lambda: make_prompts(config))

  def batches(setup, process_index, process_count):
    if process_index == 0:
      print(objectives.describe(config), flush=True)
      if isinstance(prompts().task, code_tasks.CodeTask):
        record_sandbox(config, prompts().task)
    return rollout_lib.make_batches(
      config, setup, prompts(), process_index=process_index, process_count=process_count
    )

  def evaluator(setup):
    return rl_evaluation.HeldOutReward(config, setup, prompts())

  def example_batch(rng):
    """A rollout's arrays: prompts of half the prompt width, completions filling the canvas."""
    rows = config.train.global_batch_size
    prompt = config.rl.max_prompt_tokens
    width = prompt + config.sampler.gen_length
    prompt_lengths = np.full((rows,), prompt // 2, np.int32)
    completion_mask = np.zeros((rows, width), np.float32)
    completion_mask[:, prompt // 2 : width - prompt // 2] = 1.0
    batch = dict(
      tokens=base.random_tokens(config, rng, (rows, width)),
      prompt_lengths=prompt_lengths,
      lengths=np.full((rows,), width - prompt // 2, np.int32),
      mask_seeds=np.arange(rows, dtype=np.int32),
      advantages=rng.standard_normal(rows).astype(np.float32),
      old=np.zeros(_estimate_shape(config, rows, width), np.float32),
      ref=np.zeros(_estimate_shape(config, rows, width), np.float32),
      weight=rollout_lib.loss_weights(
        completion_mask, config.rl.objective, group_size=config.rl.group_size
      ),
      completion_mask=completion_mask,
      rewards=rng.integers(0, 2, rows).astype(np.float32),
    )
    if 'steps' in rollout_lib.batch_keys(config.rl.objective):  # one token per step
      batch['steps'] = np.where(completion_mask > 0, np.arange(width)[None], -1).astype(np.int32)
    if 'targets' in rollout_lib.batch_keys(config.rl.objective):  # x_l fully masked
      batch['targets'] = batch['tokens']
      batch['tokens'] = np.where(
        completion_mask > 0, config.model.mask_token_id, batch['tokens']
      ).astype(np.int32)
    return batch

  return base.Stage(
    name='rl',
    loss=make_loss(config),
    batch_keys=rollout_lib.batch_keys(config.rl.objective),
    metrics=metrics,
    batches=batches,
    evaluator=evaluator,
    example_batch=example_batch,
    # Per step: reward, KL, clip; the latest rollout's generate / score seconds; the update's;
    # for a code task, the rollout's share of each sandbox verdict (only its rows hold them).
    console_metrics=(
      'reward_mean',
      'kl',
      'clip_fraction',
      'generate_s',
      'score_s',
      'step_time_s',
      *(f'code_{v}' for v in code_exec.VERDICTS),
    ),
  )


def _estimate_shape(config, rows: int, width: int) -> tuple[int, ...]:
  """d1 and coupled-GRPO score tokens ([B, W] log-probs), the others sequences ([B])."""
  return (rows, width) if config.rl.objective in objectives.TOKEN_OBJECTIVES else (rows,)
