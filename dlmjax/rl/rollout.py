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
import numpy as np

from dlmjax import model as model_lib
from dlmjax.diffusion import sampling_config
from dlmjax.model import programs
from dlmjax.parallel import distributed, rules
from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl import canvas, objectives
from dlmjax.rl import reference as reference_lib
from dlmjax.rl import reward_model as reward_model_lib
from dlmjax.rl import sampler as rl_sampler


NO_SIGNAL_ROLLOUTS = 3  # consecutive rollouts of equal rewards before the run says so


class NoSignalWatch:
  """Says once per streak, in one line, when every reward of the last NO_SIGNAL_ROLLOUTS rollouts
  was the same value: every advantage is then zero (r - group mean, and any normalisation of it),
  so the updates carry only the KL term and the policy learns nothing from the task."""

  def __init__(self, config):
    self.config, self.streak = config, 0

  def observe(self, rewards) -> str | None:
    rewards = np.asarray(rewards)
    equal = rewards.size > 0 and bool(np.all(rewards == rewards.flat[0]))
    self.streak = self.streak + 1 if equal else 0
    if self.streak != NO_SIGNAL_ROLLOUTS:
      return None
    if self.config.sampler.temperature == 0:  # a group's G completions are then one completion
      fix = 'set --config.sampler.temperature above 0 (e.g. 0.9) so that completions differ'
    else:
      fix = (
        'start from a model that solves some of the task (init_from a longer SFT run), or '
        'raise --config.rl.group_size'
      )
    return (
      f'no reward signal: every reward of the last {self.streak} rollouts was '
      f'{float(rewards.flat[0]):g} (rl.task={self.config.rl.task}), so every advantage is 0 and '
      f'the policy learns nothing from the task; {fix}.'
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
    self.config, self.r, self.objective = config, config.rl, objectives.of(config)
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
    # rl.reward_model: a reward model scores the completions beside the log-probs.
    self.reward_model = (
      reward_model_lib.RewardModel(config.rl.reward_model, setup.mesh, policy=config)
      if config.rl.reward_model
      else None
    )
    self.served = 0  # batches handed out; rollout = served // inner_updates
    self._batch = None
    self._reward_thread = concurrent.futures.ThreadPoolExecutor(1, 'rewards')
    self.no_signal = NoSignalWatch(config)

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
    per_update = ('old_all', 'ref_all', 'update_rows_all')
    batch = {k: v for k, v in self._batch.items() if k not in per_update}
    batch['mask_seeds'] = self._batch['mask_seeds_all'][inner]
    batch['old'], batch['ref'] = self._batch['old_all'][inner], self._batch['ref_all'][inner]
    if 'update_rows_all' in self._batch:  # the objective's rows of this update (wd1++'s steps)
      batch.update(self._batch['update_rows_all'][inner])
    del batch['mask_seeds_all']
    self.served += 1
    rows = self.config.train.global_batch_size // self.shards
    return {k: v[self.shard * rows : (self.shard + 1) * rows] for k, v in batch.items()}, row

  def _rollout(self, index: int, params) -> tuple[dict, dict]:
    config, r, objective = self.config, self.r, self.objective
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
    out, recorded = split_records(
      self.sampler.generate(params, prompt_BP, prompt_lengths, key), objective.records
    )
    generate_s = time.time() - start
    # Score: rewards, advantages, old and reference estimates for every inner iteration. The
    # rewards (for code tasks, sandboxes: seconds of subprocesses) are computed on a host thread
    # while the accelerator computes the log-probs, which need only the tokens; a reward model
    # (rl.reward_model) scores on the accelerator after them, and the task's host work then
    # gives the correctness alone.
    start = time.time()
    scored = objective.scored_completions(prompt_BP, out, recorded)
    per_row = len(scored) // rows  # completions scored per row (wd1++: one per step)
    score_examples = [e for e in examples for _ in range(per_row)]
    texts = self.sampler.texts(scored)
    tokens, completion_mask, lengths = canvas.to_right_padded(
      out,
      prompt_lengths,
      r.max_prompt_tokens,
      eos_id=m.eos_token_id,
      pad_id=m.pad_token_id,
      after_eos=objective.after_eos,
    )
    seeds = np.stack(
      [
        (index * r.inner_updates + j) * rows + np.arange(rows, dtype=np.int64)
        for j in range(r.inner_updates)
      ]
    ).astype(np.int32)
    steps = None
    if 'steps' in objective.batch_keys:
      steps = canvas.steps_right_padded(recorded['steps'], prompt_lengths, tokens.shape[1])

    def on_device():
      estimates = self._old_and_reference(params, tokens, prompt_lengths, lengths, seeds, steps)
      if self.reward_model is None:
        return estimates, None
      rows_S = self.reward_model.rows(
        scored, np.repeat(prompt_lengths, per_row), r.max_prompt_tokens
      )
      return estimates, self.reward_model(rows_S, batch_size=rows)

    (
      ((rewards, failures, correct, counters), reward_s),
      (((old_all, ref_all), learned), logprob_s),
    ) = overlapped(
      self._reward_thread,
      lambda: score_texts(self.prompts.task, score_examples, texts),
      on_device,
    )
    if learned is not None:
      rewards, failures = learned, 0
    rewards, correct, advantages, per_update, extra = objective.outcomes(
      rewards.reshape(rows, per_row), np.asarray(correct, bool).reshape(rows, per_row), group, r
    )
    update_rows = [
      objective.update_rows(config, prompt_BP, prompt_lengths, recorded, per_update, seeds_B)
      for seeds_B in seeds
    ]
    score_s = time.time() - start
    warning = self.no_signal.observe(rewards)
    if warning is not None and jax.process_index() == 0:
      print(warning, flush=True)
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
      **extra,  # the objective's own (wd1++: the mean reward of all G x L step predictions)
    )
    batch = dict(
      tokens=tokens,
      prompt_lengths=prompt_lengths,
      lengths=lengths,
      mask_seeds_all=seeds,
      advantages=advantages,
      old_all=old_all,
      ref_all=ref_all,
      weight=objective.loss_weights(completion_mask, group_size=group),
      completion_mask=completion_mask,
      rewards=rewards,
    )
    if steps is not None:
      batch['steps'] = steps
    if any(rows_j is not None for rows_j in update_rows):
      batch['update_rows_all'] = update_rows
    return batch, row

  def _old_and_reference(self, params, tokens, prompt_lengths, lengths, seeds, steps=None):
    """Per inner iteration, the rollout policy's and the reference's estimates with that
    iteration's mask seeds (the reference's are the old ones when there is no reference). An
    objective with neither a ratio nor a KL term scores nothing: zeros. One whose estimate draws
    no masks (TraceRL's states are the trajectory's) is scored once for every iteration."""
    if self.objective.scores is None:
      zeros = np.zeros(tokens.shape[:1], np.float32)
      return [zeros] * len(seeds), [zeros] * len(seeds)
    old_all, ref_all = [], []
    reference = None if self.reference is None else self.reference.params()
    for j, seeds_B in enumerate(seeds):
      if not self.objective.draws_masks and j:  # the first iteration's estimates serve all
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


def split_records(generated, records: tuple[str, ...]):
  """(sampler rows, {record name: array}) of the sampler's output for an objective's records:
  'steps' (each completion token's commit step), 'predictions' (every step's predicted
  completion, recorded with the steps)."""
  if not records:
    return generated, {}
  if 'predictions' in records:
    out, steps, predictions = generated
    return out, dict(steps=steps, predictions=predictions)
  out, steps = generated
  return out, dict(steps=steps)


def make_batches(config, setup, prompts, *, process_index: int = 0, process_count: int = 1):
  """The rollout source of a run: its sampler and, when the KL needs one, its reference."""
  sampler = rl_sampler.RolloutSampler(
    config,
    setup,
    prompts.tokenizer,
    sampling_config.SamplingConfig.from_config(config),
    with_steps='steps' in objectives.of(config).records,
    with_predictions='predictions' in objectives.of(config).records,
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
  estimate (its `estimate`, the loss's: d1, coupled-GRPO, TraceRL from the commit steps: token
  log-probs [B, L]; ESPO: sequence ELBO [B]) without gradients, params in any float dtype (taken
  as float32; a LoRA base's int8 weights stay int8, model/quantize.py).

  The run's seed reaches the program as its mask key, an argument: runs that differ only in
  `seed` (the demo's seeds, a sweep) share one compiled program (`score.func`)."""
  objective = objectives.of(config)
  settings = tuple(sorted(objective.settings(config).items()))
  program = _score_program(model_config, objective.name, settings)
  return functools.partial(program, seed_key=jax.random.key(config.seed))


@functools.lru_cache(maxsize=16)  # one compilation per model and estimator, whatever the seed
def _score_program(model_config, name, settings):
  objective = objectives.get(name)

  def fn(params, tokens, prompt_lengths, lengths, mask_seeds, steps=None, *, seed_key):
    params = programs.as_float32_params(params, model_config.matmul_dtype)
    arrays = dict(
      tokens=tokens,
      prompt_lengths=prompt_lengths,
      lengths=lengths,
      mask_seeds=mask_seeds,
      steps=steps,
    )
    module = model_lib.merge(model_config, params)
    return objective.estimate(module, arrays, seed=seed_key, settings=dict(settings))

  return programs.jit_program(fn, model_config.matmul_dtype)
