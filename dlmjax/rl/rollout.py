"""The RL batch source: G completions per prompt sampled from the params it is given, scored,
then served rl.inner_updates times (one mask seed each, old/ref estimates precomputed).

The pieces it composes: the training prompts (rl/prompts.py), the rollout sampler
(rl/sampler.py), the task's reward (advantages.score) and the reference model (rl/reference.py).
Rollouts never leave the device mesh except as token ids and rewards for scoring on the host.
"""

from __future__ import annotations

import concurrent.futures
import functools
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import model as model_lib
from dlmjax.diffusion import sampler as sampler_lib
from dlmjax.model import programs
from dlmjax.parallel import distributed, rules
from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl import estimators, objectives
from dlmjax.rl import reference as reference_lib
from dlmjax.rl import sampler as rl_sampler

BATCH_KEYS = (
  'tokens',
  'prompt_lengths',
  'lengths',
  'mask_seeds',
  'advantages',
  'old',
  'ref',
  'weight',
  'completion_mask',
  'rewards',
)


def batch_keys(objective: str) -> tuple[str, ...]:
  """The batch's arrays: BATCH_KEYS, `steps` (each token's commit step) for TraceRL, `targets`
  (the drawn step's predicted completion) for wd1++."""
  extra = ('steps',) if objective in objectives.TRAJECTORY_OBJECTIVES else ()
  return BATCH_KEYS + extra + (('targets',) if objective in objectives.STEPWISE_OBJECTIVES else ())


def steps_right_padded(steps_BG, prompt_lengths_B, width: int):
  """The sampler's commit steps [B, gen] placed like to_right_padded's canvas: int32 [B, W],
  -1 on the prompt and the pads."""
  steps_BG = np.asarray(steps_BG, np.int32)
  steps = np.full((steps_BG.shape[0], width), -1, np.int32)
  for b, p in enumerate(np.asarray(prompt_lengths_B)):
    steps[b, p : p + steps_BG.shape[1]] = steps_BG[b]
  return steps


def to_right_padded(out_BW, prompt_lengths_B, prompt_width: int, *, eos_id: int, pad_id: int):
  """Sampler output (left-padded prompt + canvas) -> rows [prompt, canvas, pads] of width W, the
  canvas after its first EOS rewritten to EOS; also (completion mask up to and incl. the first
  EOS [B, W] float32, lengths [B])."""
  out_BW = np.asarray(out_BW)
  batch, width = out_BW.shape
  gen = width - prompt_width
  tokens = np.full((batch, width), pad_id, np.int32)
  mask = np.zeros((batch, width), np.float32)
  lengths = np.asarray(prompt_lengths_B, np.int32) + gen
  for b in range(batch):
    p = int(prompt_lengths_B[b])
    canvas = out_BW[b, prompt_width:].copy()
    eos = np.flatnonzero(canvas == eos_id)
    end = int(eos[0]) + 1 if len(eos) else gen
    canvas[end:] = eos_id
    tokens[b, :p] = out_BW[b, prompt_width - p : prompt_width]
    tokens[b, p : p + gen] = canvas
    mask[b, p : p + end] = 1.0
  return tokens, mask, lengths


def loss_weights(
  completion_mask_BL, objective: str, normalisation: str = 'token', group_size: int = 0
):
  """Each unit's share of the global batch loss: per token (d1, coupled-GRPO) or per sequence.

  d1 'token': mask / the global batch's completion tokens, DAPO's token mean (d1 takes the token
  mean per micro-batch of 6 rows and averages the micro-batches; with equal lengths both agree);
  'sequence': mask / (tokens of the row x rows) (GRPO). ESPO: 1 / rows per sequence. SPG: the
  row's completion length / all rows' (SPG's length-weighted sequence average). wd1: G / rows
  per sequence, the sum over a group's rows averaged over the groups (wd1's loss is the sum over
  a micro-batch of one group, averaged over micro-batches)."""
  rows = completion_mask_BL.shape[0]
  if objective == 'espo':
    return np.full((rows,), 1.0 / rows, np.float32)
  if objective in ('wd1', 'wd1pp'):  # wd1pp: times L / G / t_l (stepwise_rows)
    if group_size < 2:
      raise ValueError('wd1 loss weights need the group size (group_size=rl.group_size).')
    return np.full((rows,), group_size / rows, np.float32)
  if objective == 'spg':
    lengths = completion_mask_BL.sum(axis=1)
    return (lengths / max(lengths.sum(), 1.0)).astype(np.float32)
  if normalisation == 'token':
    return (completion_mask_BL / max(completion_mask_BL.sum(), 1.0)).astype(np.float32)
  per_row = np.maximum(completion_mask_BL.sum(axis=1, keepdims=True), 1.0)
  return (completion_mask_BL / per_row / rows).astype(np.float32)


def stepwise_draws(seed: int, mask_seeds_B, num_steps: int):
  """wd1++'s step per row: int [B] in [0, num_steps) (step l = draw + 1), a function of the
  run's seed and the row's mask seed only, like every other RL mask draw."""
  return np.array(
    [
      np.random.default_rng([7, seed % 2**32, int(s) % 2**32]).integers(num_steps)
      for s in np.asarray(mask_seeds_B)
    ],
    np.int64,
  )


def stepwise_rows(
  prompt_BP,
  prompt_lengths_B,
  preds_BSG,
  steps_BG,
  weights_BS,
  draws_B,
  *,
  group_size: int,
  mask_id: int,
  eos_id: int,
  pad_id: int,
  dce_weight: bool = True,
):
  """wd1++'s rows for one inner update: each row's drawn step l (draws_B, 0-based), right-padded
  like to_right_padded. tokens: the state x_l, the final completion with MASK wherever the commit
  step is >= l (the sampler's state before step l); targets / completion_mask: that step's
  predicted completion x_0|l, rewritten to EOS after its first EOS, and its mask up to it;
  advantages: its signed weight (w+ - w-); weight: its loss weight G / rows (a prompt's rows
  summed, the prompts averaged) x L / G x (dce_weight: 1 / t_l, t_l = x_l's masked share of the
  canvas, which is 1 at l = 1)."""
  batch, num_steps, gen = preds_BSG.shape
  rows = np.arange(batch)
  width = prompt_BP.shape[1]
  out_BW = np.concatenate([np.asarray(prompt_BP), preds_BSG[rows, draws_B]], axis=1)
  raw, _, lengths = to_right_padded(out_BW, prompt_lengths_B, width, eos_id=-1, pad_id=pad_id)
  targets, mask, _ = to_right_padded(out_BW, prompt_lengths_B, width, eos_id=eos_id, pad_id=pad_id)
  steps = steps_right_padded(steps_BG, prompt_lengths_B, raw.shape[1])
  masked = steps >= draws_B[:, None]  # -1 on the prompt and the pads: never masked
  t_B = masked.sum(axis=1) / gen
  factor = num_steps / group_size / (t_B if dce_weight else 1.0)
  weight = loss_weights(mask, 'wd1pp', group_size=group_size) * factor
  return dict(
    tokens=np.where(masked, mask_id, raw).astype(np.int32),
    targets=targets,
    lengths=lengths,
    completion_mask=mask,
    advantages=weights_BS[rows, draws_B].astype(np.float32),
    weight=weight.astype(np.float32),
  )


class RolloutBatches:
  """The RL stage's BatchSource: `next(params)` -> (this process's rows of the batch, the
  rollout's metrics row or None).

  prompts: rl.prompts.Prompts; sampler: rl.sampler.RolloutSampler; reference: a
  rl.reference.ReferenceModel or None.
  """

  def __init__(
    self,
    config,
    setup,
    prompts,
    sampler,
    reference=None,
    *,
    process_index: int = 0,
    process_count: int = 1,
  ):
    self.config, self.r = config, config.rl
    self.setup, self.prompts, self.sampler, self.reference = setup, prompts, sampler, reference
    # Several processes: each builds the same whole rollout (same prompts and keys, the sampler
    # and scorer run over the global mesh) and serves the block of rows its devices hold.
    self.shard, self.shards = process_index, process_count
    self.score_fn = make_score_fn(config, setup.model_config)
    self.reference_score_fn = None
    if reference is not None:
      same = reference.model_config == setup.model_config
      self.reference_score_fn = (
        self.score_fn if same else make_score_fn(config, reference.model_config)
      )
    self.served = 0  # batches handed out; rollout = served // inner_updates
    self._batch = None
    self._reward_thread = concurrent.futures.ThreadPoolExecutor(1, 'rewards')

  def get_state(self) -> dict:
    return dict(served=self.served)

  def use_reference(self, state_reference) -> None:
    """The train state's refreshed reference (rl.ref_sync_every > 0) for the next rollout."""
    self.reference.use(state_reference)

  def set_state(self, state: dict) -> None:
    """Resumes the rollout count; a rollout cut by the checkpoint is generated afresh."""
    self.served = int(state['served'])
    if self.served % self.r.inner_updates:
      self.served += self.r.inner_updates - self.served % self.r.inner_updates

  def next(self, params) -> tuple[dict, dict | None]:
    inner = self.served % self.r.inner_updates
    row = None
    if inner == 0 or self._batch is None:
      self._batch, row = self._rollout(self.served // self.r.inner_updates, params)
    per_update = ('old_all', 'ref_all', 'stepwise_all')
    batch = {k: v for k, v in self._batch.items() if k not in per_update}
    batch['mask_seeds'] = self._batch['mask_seeds_all'][inner]
    batch['old'], batch['ref'] = self._batch['old_all'][inner], self._batch['ref_all'][inner]
    if 'stepwise_all' in self._batch:  # wd1++: this update's drawn steps
      batch.update(self._batch['stepwise_all'][inner])
    del batch['mask_seeds_all']
    self.served += 1
    rows = self.config.train.global_batch_size // self.shards
    return {k: v[self.shard * rows : (self.shard + 1) * rows] for k, v in batch.items()}, row

  def _rollout(self, index: int, params) -> tuple[dict, dict]:
    config, r = self.config, self.r
    m = config.model
    rows, group = config.train.global_batch_size, r.group_size
    training = self.prompts.training
    rng = random.Random(f'{config.seed}:rollout:{index}')
    chosen = [rng.randrange(len(training.examples)) for _ in range(rows // group)]
    examples = [training.examples[i] for i in chosen for _ in range(group)]
    prompt_BP, prompt_lengths = self.sampler.pad(
      [training.token_ids[i] for i in chosen for _ in range(group)]
    )
    # Generate.
    if self._batch is None and jax.process_index() == 0:  # the first rollout compiles the sampler
      print(
        f'rollout {index + 1}: sampling {rows} completions of {config.sampler.gen_length} tokens '
        '(the first compiles the sampler)...',
        flush=True,
      )
    start = time.time()
    key = jax.random.fold_in(jax.random.key(config.seed), index)
    out = self.sampler.generate(params, prompt_BP, prompt_lengths, key)
    steps = preds = None
    if r.objective in objectives.TRAJECTORY_OBJECTIVES:
      out, steps = out
    if r.objective in objectives.STEPWISE_OBJECTIVES:
      out, steps_BG, preds = out
    generate_s = time.time() - start
    # Score: rewards, advantages, old and reference estimates for every inner iteration. The
    # rewards (for code tasks, sandboxes: seconds of subprocesses) are computed on a host thread
    # while the accelerator computes the log-probs, which need only the tokens.
    start = time.time()
    extra = {}
    if preds is None:
      score_examples, texts = examples, self.sampler.texts(out)
    else:  # wd1++: every step's prediction scored, G x L per prompt, in one call
      num_steps = preds.shape[1]
      expanded = np.concatenate(
        [np.repeat(prompt_BP, num_steps, axis=0), preds.reshape(rows * num_steps, -1)], axis=1
      )
      score_examples = [e for e in examples for _ in range(num_steps)]
      texts = self.sampler.texts(expanded)
    tokens, completion_mask, lengths = to_right_padded(
      out, prompt_lengths, r.max_prompt_tokens, eos_id=m.eos_token_id, pad_id=m.pad_token_id
    )
    seeds = np.stack(
      [
        (index * r.inner_updates + j) * rows + np.arange(rows, dtype=np.int64)
        for j in range(r.inner_updates)
      ]
    ).astype(np.int32)
    if steps is not None:
      steps = steps_right_padded(steps, prompt_lengths, tokens.shape[1])
    ((rewards, failures, correct, counters), reward_s), ((old_all, ref_all), logprob_s) = (
      overlapped(
        self._reward_thread,
        lambda: score_texts(self.prompts.task, score_examples, texts),
        lambda: self._old_and_reference(params, tokens, prompt_lengths, lengths, seeds, steps),
      )
    )
    stepwise_all = None
    if preds is None:
      advantages = row_advantages(rewards, group, r.objective)
    else:
      extra = dict(rollout_step_reward_mean=float(rewards.mean()))
      rewards_BS = rewards.reshape(rows, num_steps)
      weights_BS = advantages_lib.wd1pp_weights(rewards_BS, group, r.wd1pp_psi)
      rewards, advantages = rewards_BS[:, -1], weights_BS[:, -1]  # x_0|L: the completion
      correct = np.asarray(correct, bool).reshape(rows, num_steps)[:, -1]
      stepwise_all = [
        stepwise_rows(
          prompt_BP,
          prompt_lengths,
          preds,
          steps_BG,
          weights_BS,
          stepwise_draws(config.seed, seeds_B, num_steps),
          group_size=group,
          mask_id=m.mask_token_id,
          eos_id=m.eos_token_id,
          pad_id=m.pad_token_id,
          dce_weight=r.wd1pp_dce_weight,
        )
        for seeds_B in seeds
      ]
    score_s = time.time() - start
    row = dict(
      step=self.served + 1,
      rollout=index,
      generate_s=generate_s,
      score_s=score_s,
      reward_s=reward_s,
      logprob_s=logprob_s,
      rollout_reward_mean=float(rewards.mean()),
      rollout_reward_std=float(rewards.std()),
      rollout_accuracy=float(np.mean(correct)),
      reward_failures=failures,
      rollout_completion_length=float(completion_mask.sum(1).mean()),
      **counters,  # code tasks: the share of each sandbox verdict
      **extra,  # wd1++: the mean reward of all G x L step predictions
    )
    batch = dict(
      tokens=tokens,
      prompt_lengths=prompt_lengths,
      lengths=lengths,
      mask_seeds_all=seeds,
      advantages=advantages,
      old_all=old_all,
      ref_all=ref_all,
      weight=loss_weights(completion_mask, r.objective, group_size=group),
      completion_mask=completion_mask,
      rewards=rewards,
    )
    if steps is not None:
      batch['steps'] = steps
    if stepwise_all is not None:
      batch['stepwise_all'] = stepwise_all
    return batch, row

  def _old_and_reference(self, params, tokens, prompt_lengths, lengths, seeds, steps=None):
    """Per inner iteration, the rollout policy's and the reference's estimates with that
    iteration's mask seeds (the reference's are the old ones when there is no reference).
    SPG and wd1 have neither a ratio nor a KL: zeros, nothing computed. TraceRL's estimate
    draws nothing (its states are the trajectory's): computed once, served to every iteration."""
    if self.r.objective in objectives.RATIO_FREE:
      zeros = np.zeros(tokens.shape[:1], np.float32)
      return [zeros] * len(seeds), [zeros] * len(seeds)
    old_all, ref_all = [], []
    reference = None if self.reference is None else self.reference.params()
    for j, seeds_B in enumerate(seeds):
      if steps is not None and j:  # deterministic: the first iteration's estimates serve all
        old_all.append(old_all[0])
        ref_all.append(ref_all[0])
        continue
      old = self._score(params, tokens, prompt_lengths, lengths, seeds_B, steps)
      old_all.append(old)
      ref_all.append(
        old
        if reference is None
        else self._score(
          reference, tokens, prompt_lengths, lengths, seeds_B, steps, self.reference_score_fn
        )
      )
    return old_all, ref_all

  def _score(self, params, tokens, prompt_lengths, lengths, seeds, steps=None, score_fn=None):
    score_fn = score_fn or self.score_fn
    with rules.activation_mesh(self.setup.mesh):
      return distributed.to_host(score_fn(params, tokens, prompt_lengths, lengths, seeds, steps))


def make_batches(config, setup, prompts, *, process_index: int = 0, process_count: int = 1):
  """The rollout source of a run: its sampler and, when the KL needs one, its reference."""
  sampler = rl_sampler.RolloutSampler(
    config,
    setup,
    prompts.tokenizer,
    sampler_lib.SamplingConfig.from_config(config),
    with_steps=config.rl.objective in objectives.TRAJECTORY_OBJECTIVES,
    with_predictions=config.rl.objective in objectives.STEPWISE_OBJECTIVES,
  )
  reference = reference_lib.ReferenceModel(config, setup) if reference_lib.needed(config) else None
  return RolloutBatches(
    config,
    setup,
    prompts,
    sampler,
    reference,
    process_index=process_index,
    process_count=process_count,
  )


def row_advantages(rewards_B, group_size: int, objective: str):
  """What each row's loss multiplies: group-relative advantages (mean baseline; coupled-GRPO's
  leave-one-out), or for wd1 its signed weights softmax(A) - softmax(-A) per group."""
  if objective == 'coupled_grpo':
    return advantages_lib.group_advantages(rewards_B, group_size, baseline='leave_one_out')
  advantages = advantages_lib.group_advantages(rewards_B, group_size)
  if objective == 'wd1':
    return advantages_lib.wd1_weights(advantages, group_size)
  return advantages


def overlapped(thread, on_host, here):
  """((on_host(), its seconds), (here(), its seconds)): on_host runs on `thread` (an executor)
  while `here` runs on the calling thread, so host work (a code task's sandboxes wait seconds on
  subprocesses) overlaps the accelerator's (the log-probs, which need only the tokens)."""

  def timed(fn):
    start = time.time()
    return fn(), time.time() - start

  future = thread.submit(timed, on_host)
  mine = timed(here)
  return future.result(), mine


def score_texts(task, examples, texts):
  """(rewards [B], reward failures, correct [B], counters) of completions, never raising;
  counters: for code tasks the share of completions per sandbox verdict ({'code_passed': ..,
  'code_failed', 'code_timeout', 'code_memory', 'code_crash', 'code_refused'}), else {}."""
  if getattr(task, 'parallel', False):  # code tasks: one batch of parallel sandboxes
    rewards, correct, counters = task.judge_counted(examples, texts)
    return np.asarray(rewards, np.float32), 0, correct, counters
  rewards, failures = advantages_lib.score(task.reward, examples, texts)
  return rewards, failures, [_safe_correct(task, e, t) for e, t in zip(examples, texts)], {}


def _safe_correct(task, example, completion) -> bool:
  try:
    return bool(task.is_correct(example, completion))
  except Exception:  # pylint: disable=broad-except
    return False


def make_score_fn(config, model_config):
  """score(params, tokens, prompt_lengths, lengths, mask_seeds, steps=None): the objective's
  estimate (d1, coupled-GRPO, wd1, TraceRL from the commit steps: token log-probs [B, L]; ESPO:
  sequence ELBO [B]) without gradients, params in any float dtype (taken as float32; a LoRA
  base's int8 weights stay int8, model/quantize.py).

  The run's seed reaches the program as its mask key, an argument: runs that differ only in
  `seed` (the demo's seeds, a sweep) share one compiled program (`score.func`)."""
  r = config.rl
  program = _score_program(
    model_config,
    r.objective,
    r.p_mask_prompt,
    r.elbo_samples,
    config.model.mask_token_id,
    config.model.loss_chunk_tokens,
    trace_rounds(config),
  )
  return functools.partial(program, seed_key=jax.random.key(config.seed))


@functools.lru_cache(maxsize=16)  # one compilation per model and estimator, whatever the seed
def _score_program(
  model_config, objective, p_mask_prompt, elbo_samples, mask_id, chunk_size, rounds
):
  common = dict(mask_id=mask_id, chunk_size=chunk_size)

  def fn(params, tokens, prompt_lengths, lengths, mask_seeds, steps=None, *, seed_key):
    params = jax.tree.map(
      lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
    )
    module = model_lib.merge(model_config, params)
    if objective in objectives.TRAJECTORY_OBJECTIVES:
      return estimators.trace_token_logprobs(
        module,
        tokens,
        prompt_lengths,
        lengths,
        steps,
        block_size=model_config.block_size,
        rounds=rounds,
        **common,
      )
    if objective in objectives.TOKEN_OBJECTIVES or objective == 'wd1':  # wd1 sums them
      return estimators.token_estimator(objective)(
        module,
        tokens,
        prompt_lengths,
        lengths,
        mask_seeds,
        seed=seed_key,
        p_mask_prompt=p_mask_prompt,
        **common,
      )
    return estimators.sequence_elbo(
      module,
      tokens,
      prompt_lengths,
      lengths,
      mask_seeds,
      seed=seed_key,
      num_samples=elbo_samples,
      **common,
    )

  return programs.jit_program(fn, model_config.matmul_dtype)


def trace_rounds(config) -> int:
  """TraceRL's rounds per model block: a block holds at most min(block_size, steps per block)
  distinct commit steps."""
  sampling = sampler_lib.SamplingConfig.from_config(config)
  return min(config.model.block_size, sampling.steps_per_block)


def trace_logprobs(config, module, tokens, prompt_lengths, lengths, steps):
  """TraceRL's token estimate (estimators.trace_token_logprobs) with the run's block sizes."""
  m = config.model
  return estimators.trace_token_logprobs(
    module,
    tokens,
    prompt_lengths,
    lengths,
    steps,
    block_size=m.block_size,
    rounds=trace_rounds(config),
    mask_id=m.mask_token_id,
    chunk_size=m.loss_chunk_tokens,
  )
