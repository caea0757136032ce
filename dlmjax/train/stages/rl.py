"""RL from verifiable rewards: rollouts of the current policy and the loss of the run's objective
(diffu-GRPO (d1), ESPO, SPG, wd1, wd1++, coupled-GRPO, TraceRL: the registry rl/objectives/).

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
from dlmjax.data import records, run_tokenizer
from dlmjax.data.errors import DataError
from dlmjax.tasks import code as code_tasks
from dlmjax.tasks import code_exec
from dlmjax.rl import objectives
from dlmjax.rl import evaluation as rl_evaluation
from dlmjax.rl import prompts as prompts_lib
from dlmjax.rl import reference as reference_lib
from dlmjax.rl import rollout as rollout_lib
from dlmjax.train.stages import base


def make_loss(config):
  """loss(module, tokens=, prompt_lengths=, lengths=, ...) -> (objective, sums): the run's
  objective's loss on its estimate (rl/objectives/).

  `weight` holds each unit's share of the GLOBAL batch average (the objective's loss_weights),
  so each micro-batch's weighted sum is its share of the step's loss, as the step's rule wants.
  """
  objective, r = objectives.of(config), config.rl
  settings = objective.settings(config)

  def fn(module, *, step=None, micro_index=None, example_ids_B=None, **arrays):
    del step, micro_index, example_ids_B  # randomness comes from the rollout's mask seeds
    estimate = objective.estimate(module, arrays, seed=config.seed, settings=settings)
    loss, kl, clipped = objective.loss(estimate, arrays, r)
    weight, completion_mask, rewards = (
      arrays['weight'],
      arrays['completion_mask'],
      arrays['rewards'],
    )
    total = jnp.sum(weight * loss)
    sums = dict(
      loss_sum=total,
      kl_sum=jnp.sum(weight * kl),
      clip_sum=jnp.sum(weight * clipped.astype(jnp.float32)),
      tokens=jnp.sum(completion_mask),
      rows=jnp.float32(arrays['tokens'].shape[0]),
      reward_sum=jnp.sum(rewards),
      reward_sq_sum=jnp.sum(jnp.square(rewards)),
    )
    return total, sums

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
  keys = objectives.of(config).batch_keys

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
      weight=objectives.of(config).loss_weights(completion_mask, group_size=config.rl.group_size),
      completion_mask=completion_mask,
      rewards=rng.integers(0, 2, rows).astype(np.float32),
    )
    if 'steps' in keys:  # one token per step
      batch['steps'] = np.where(completion_mask > 0, np.arange(width)[None], -1).astype(np.int32)
    if 'targets' in keys:  # x_l fully masked
      batch['targets'] = batch['tokens']
      batch['tokens'] = np.where(
        completion_mask > 0, config.model.mask_token_id, batch['tokens']
      ).astype(np.int32)
    return batch

  return base.Stage(
    name='rl',
    loss=make_loss(config),
    batch_keys=keys,
    data_keys=(
      'rl.task',
      'rl.task_data',
      'data.columns',
      'rl.num_prompts',
      'rl.max_prompt_tokens',
      'seed',
    ),
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
    check_inputs=lambda: check_task_files(config),
    # An MoE's router losses join RL's objective only when asked (rl.router_losses), and then the
    # logged loss is the whole objective: the surrogate alone means nothing.
    router_losses=config.rl.router_losses,
    loss_is_objective=True,
    carried=refreshed_reference(config),
    resident_param_bytes=reference_bytes_per_param(config),
  )


def check_task_files(config) -> None:
  """The task's data files (rl.task_data) exist."""
  if config.rl.task not in tasks_lib.FILE_TASKS:
    return
  for path in filter(None, config.rl.task_data.split(',')):
    if not records.exists(path):
      raise DataError(
        f'rl.task_data names {path!r}, which is not a file; set '
        '--config.rl.task_data=TRAIN.jsonl[,TEST.jsonl] (parquet, json, arrow or hub:NAME).'
      )


def refreshed_reference(config) -> base.CarriedState | None:
  """With rl.ref_sync_every > 0 the KL reference lives in the train state (rl/reference.py):
  the init params at step 0, refreshed after every N-th step, handed to the rollout before each
  batch."""
  if not reference_lib.synced(config):
    return None
  r = config.rl
  return base.CarriedState(
    key='reference',
    init=lambda params: reference_lib.initial(config, params),
    update=lambda new_step, reference, params: reference_lib.refresh(
      new_step, reference, params, every=r.ref_sync_every, alpha=r.ref_sync_alpha
    ),
    hand_over=lambda batches, reference: batches.use_reference(reference),
  )


def reference_bytes_per_param(config) -> float:
  """A KL term holds a reference beside the params, in rl.reference_dtype (a LoRA run's is its
  frozen base: no copy), unless it waits in host memory between rollouts (rl.reference_on_host)."""
  on_device = (
    reference_lib.needed(config) and config.train.lora.rank == 0 and not config.rl.reference_on_host
  )
  return float(jnp.dtype(config.rl.reference_dtype).itemsize) if on_device else 0.0


def _estimate_shape(config, rows: int, width: int) -> tuple[int, ...]:
  """Per-token old / reference estimates are [B, W] log-probs, the others one per row ([B])."""
  return (rows, width) if objectives.of(config).scores == 'token' else (rows,)
