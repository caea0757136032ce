"""The RL batch source: generate G completions per prompt with the current params, score them,
then serve the rollouts rl.inner_updates times (one mask seed each, old/ref estimates precomputed).

The train loop attaches it to the live state (`attach`), so each rollout samples from the params
of the step about to run; the rollouts never leave the device mesh except as token ids and
rewards for scoring on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import model as model_lib
from dlmjax import tasks as tasks_lib
from dlmjax.diffusion import sampler as sampler_lib
from dlmjax.model import programs
from dlmjax.parallel import distributed, rules
from dlmjax.rl import advantages as advantages_lib
from dlmjax.rl import estimators

BATCH_KEYS = ('tokens', 'prompt_lengths', 'lengths', 'mask_seeds', 'advantages', 'old', 'ref',
              'weight', 'completion_mask', 'rewards')


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
    tokens[b, :p] = out_BW[b, prompt_width - p:prompt_width]
    tokens[b, p:p + gen] = canvas
    mask[b, p:p + end] = 1.0
  return tokens, mask, lengths


def loss_weights(completion_mask_BL, objective: str, normalisation: str = 'token'):
  """Each unit's share of the global batch loss: per token (d1) or per sequence (ESPO).

  d1 'token': mask / total completion tokens (d1, DAPO); 'sequence': mask / (tokens of the row x
  rows) (GRPO). ESPO: 1 / rows per sequence. SPG: the row's completion length / all rows' (SPG's
  length-weighted sequence average)."""
  rows = completion_mask_BL.shape[0]
  if objective == 'espo':
    return np.full((rows,), 1.0 / rows, np.float32)
  if objective == 'spg':
    lengths = completion_mask_BL.sum(axis=1)
    return (lengths / max(lengths.sum(), 1.0)).astype(np.float32)
  if normalisation == 'token':
    return (completion_mask_BL / max(completion_mask_BL.sum(), 1.0)).astype(np.float32)
  per_row = np.maximum(completion_mask_BL.sum(axis=1, keepdims=True), 1.0)
  return (completion_mask_BL / per_row / rows).astype(np.float32)


class RolloutSource:
  """Iterator of RL batches (dicts of numpy arrays, BATCH_KEYS); `attach` before `next`."""

  def __init__(self, config, *, process_index: int = 0, process_count: int = 1):
    from dlmjax.data import sft as sft_data  # pylint: disable=import-outside-toplevel
    r = config.rl
    self.config, self.r = config, r
    # Several processes: each builds the same whole rollout (same prompts and keys, the sampler
    # and scorer run over the global mesh) and serves the block of rows its devices hold.
    self.shard, self.shards = process_index, process_count
    self.sampling = sampler_lib.SamplingConfig.from_config(config)
    self.task = tasks_lib.get_task(r.task, data_path=r.task_data)
    self.tokenizer = sft_data.load_tokenizer(config)
    self.examples, self.prompt_ids = self._prompts('train', r.num_prompts, config.seed)
    self.served = 0  # batches handed out; rollout = served // inner_updates
    self._batch = None
    self._held_out = {}  # (split, num, seed) -> (examples, prompt ids), built on first use
    self.setup = self._params = self.reporter = None

  def _prompts(self, split: str, num: int, seed: int, examples=None):
    """The split's examples (or `examples`) whose templated prompt fits rl.max_prompt_tokens,
    and their ids."""
    r = self.r
    examples = self.task.examples(split, num, seed) if examples is None else examples
    template = prompt_template(self.config)
    texts = [e.prompt if template == 'none' else _chat_prompt(template, e.prompt)
             for e in examples]
    ids = self.tokenizer.encode_batch(texts)
    kept = [(e, t) for e, t in zip(examples, ids) if 0 < len(t) <= r.max_prompt_tokens]
    if not kept:
      raise ValueError(f'task {r.task}: no {split} prompt fits rl.max_prompt_tokens='
                       f'{r.max_prompt_tokens} (asked for {num}); raise rl.max_prompt_tokens.')
    return [e for e, _ in kept], [t for _, t in kept]

  def attach(self, setup, get_params, reporter=None):
    """Called by the train loop: the mesh, a getter of the live params, the metrics reporter."""
    self.setup, self._params, self.reporter = setup, get_params, reporter
    self.generate_fn = self._make_generate_fn(self.sampling)
    self.score_fn = make_score_fn(self.config, setup.model_config)
    self.greedy_fn = None  # the held-out sampler (temperature 0), compiled on first use
    self.reference = None
    if self.r.kl_beta > 0:
      self.reference = self._load_reference()

  def _load_reference(self):
    """The frozen init model, restored again (also on resume), in rl.reference_dtype; kept on
    the mesh with the training shardings, or in host memory (rl.reference_on_host)."""
    from dlmjax.checkpoint import init_from  # pylint: disable=import-outside-toplevel
    dtype = jnp.dtype(self.r.reference_dtype)
    params = init_from.restore_params(self.config, self.setup,
                                       purpose='frozen KL reference model')
    params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p))(params)
    return jax.tree.map(distributed.to_host, params) if self.r.reference_on_host else params

  def held_out_reward(self, params, num: int, seed: int, split: str = 'test') -> dict:
    """Mean reward and accuracy of greedy completions of `num` held-out problems, decoded with
    the rollouts' canvas and steps: the held-out signal that the rollouts' own reward (on fresh
    training prompts each time, item 3 of docs/benchmarks.md's RL diagnosis) cannot give."""
    examples, texts = self.held_out_completions(params, num, seed, split)
    rewards, failures, correct = self._score_texts(examples, texts)
    return dict(val_reward=float(rewards.mean()), val_accuracy=float(np.mean(correct)),
                val_examples=len(examples), val_reward_failures=failures)

  def held_out_completions(self, params, num: int, seed: int, split: str = 'test'):
    """(examples, greedy completion texts) of `num` held-out problems whose prompt fits: the
    test split's, or for split 'valid' train-split problems that are not RL prompts. Every
    process decodes the same global batches, as in a rollout."""
    config, m = self.config, self.config.model
    if (split, num, seed) not in self._held_out:
      self._held_out[split, num, seed] = self._held_out_prompts(split, num, seed)
    if self.greedy_fn is None:
      self.greedy_fn = self._make_generate_fn(dataclasses.replace(self.sampling, temperature=0.0))
    examples, prompt_ids = self._held_out[split, num, seed]
    rows, texts = config.train.global_batch_size, []
    for start in range(0, len(examples), rows):
      chunk = prompt_ids[start:start + rows]
      chunk = chunk + [chunk[0]] * (rows - len(chunk))  # a full global batch; extras dropped
      prompt_BP, prompt_lengths = sampler_lib.pad_prompts(chunk, m.pad_token_id,
                                                          width=self.r.max_prompt_tokens)
      key = jax.random.fold_in(jax.random.key(seed), start)  # unused at temperature 0
      texts += self._decode(distributed.to_host(self.greedy_fn(params, prompt_BP, prompt_lengths,
                                                             key)))
    return examples, texts[:len(examples)]

  def _make_generate_fn(self, sampling):
    """The sampler over the attached mesh with the model's special ids."""
    m = self.config.model
    return sampler_lib.make_generate_fn(
        self.setup.model_config, sampling, mask_id=m.mask_token_id, eos_id=m.eos_token_id,
        pad_id=m.pad_token_id, mesh=self.setup.mesh, vocab_size=m.vocab_size)

  def _decode(self, out_BW) -> list[str]:
    """The completion texts (up to the first EOS) of sampler output rows."""
    return [self.tokenizer.decode(c) for c in sampler_lib.completions(
        out_BW, self.r.max_prompt_tokens, self.config.model.eos_token_id)]

  def _score_texts(self, examples, texts):
    """(rewards [B], reward failures, correct [B]) of completions, never raising."""
    rewards, failures = advantages_lib.score(self.task.reward, examples, texts)
    return rewards, failures, [_safe_correct(self.task, e, t) for e, t in zip(examples, texts)]

  def _held_out_prompts(self, split: str, num: int, seed: int):
    if split == 'test':
      return self._prompts('test', num, seed)
    if split != 'valid':
      raise ValueError(f'held-out split {split!r}: choose test or valid.')
    used = {e.prompt for e in self.examples}
    try:  # a prefix-stable draw: enough to skip every RL prompt even with the same seed
      drawn = self.task.examples('train', num + len(used), seed)
    except ValueError as e:
      raise ValueError(f'rl.eval_split=valid needs {num} train problems besides the '
                       f'{len(used)} RL prompts ({e}); lower rl.num_prompts or eval.batches, or '
                       'use rl.eval_split=test.') from None
    return self._prompts('train', num, seed, [e for e in drawn if e.prompt not in used][:num])

  # grain-like iterator protocol used by the loop and the checkpoint manager
  def __iter__(self):
    return self

  def get_state(self) -> dict:
    return dict(served=self.served)

  def set_state(self, state: dict) -> None:
    """Resumes the rollout count; a rollout cut by the checkpoint is generated afresh."""
    self.served = int(state['served'])
    if self.served % self.r.inner_updates:
      self.served += self.r.inner_updates - self.served % self.r.inner_updates

  def __next__(self) -> dict:
    if self.setup is None:
      raise RuntimeError('RolloutSource.attach(setup, get_params) must be called first.')
    inner = self.served % self.r.inner_updates
    if inner == 0 or self._batch is None:
      self._batch = self._rollout(self.served // self.r.inner_updates)
    batch = {k: v for k, v in self._batch.items() if k not in ('old_all', 'ref_all')}
    batch['mask_seeds'] = self._batch['mask_seeds_all'][inner]
    batch['old'], batch['ref'] = self._batch['old_all'][inner], self._batch['ref_all'][inner]
    del batch['mask_seeds_all']
    self.served += 1
    rows = self.config.train.global_batch_size // self.shards
    return {k: v[self.shard * rows:(self.shard + 1) * rows] for k, v in batch.items()}

  def _rollout(self, index: int) -> dict:
    config, r = self.config, self.r
    m = config.model
    rows, group = config.train.global_batch_size, r.group_size
    rng = random.Random(f'{config.seed}:rollout:{index}')
    chosen = [rng.randrange(len(self.examples)) for _ in range(rows // group)]
    examples = [self.examples[i] for i in chosen for _ in range(group)]
    prompt_BP, prompt_lengths = sampler_lib.pad_prompts(
        [self.prompt_ids[i] for i in chosen for _ in range(group)], m.pad_token_id,
        width=r.max_prompt_tokens)
    # Generate.
    start = time.time()
    params = self._params()
    key = jax.random.fold_in(jax.random.key(config.seed), index)
    out = distributed.to_host(self.generate_fn(params, prompt_BP, prompt_lengths, key))
    generate_s = time.time() - start
    # Score: rewards, advantages, old and reference estimates for every inner iteration.
    start = time.time()
    texts = self._decode(out)
    rewards, failures, correct = self._score_texts(examples, texts)
    advantages = advantages_lib.group_advantages(rewards, group)
    tokens, completion_mask, lengths = to_right_padded(
        out, prompt_lengths, r.max_prompt_tokens, eos_id=m.eos_token_id, pad_id=m.pad_token_id)
    seeds = np.stack([(index * r.inner_updates + j) * rows + np.arange(rows, dtype=np.int64)
                      for j in range(r.inner_updates)]).astype(np.int32)
    old_all, ref_all = self._old_and_reference(params, tokens, prompt_lengths, lengths, seeds)
    score_s = time.time() - start
    if self.reporter is not None:
      self.reporter.write_row(dict(
          step=self.served + 1, rollout=index, generate_s=generate_s, score_s=score_s,
          rollout_reward_mean=float(rewards.mean()), rollout_reward_std=float(rewards.std()),
          rollout_accuracy=float(np.mean(correct)), reward_failures=failures,
          rollout_completion_length=float(completion_mask.sum(1).mean())))
    return dict(tokens=tokens, prompt_lengths=prompt_lengths, lengths=lengths,
                mask_seeds_all=seeds, advantages=advantages, old_all=old_all, ref_all=ref_all,
                weight=loss_weights(completion_mask, r.objective),
                completion_mask=completion_mask, rewards=rewards)

  def _old_and_reference(self, params, tokens, prompt_lengths, lengths, seeds):
    """Per inner iteration, the rollout policy's and the reference's estimates with that
    iteration's mask seeds (the reference's are the old ones when there is no reference).
    SPG has neither a ratio nor a KL: zeros, nothing computed."""
    if self.r.objective == 'spg':
      zeros = np.zeros(tokens.shape[:1], np.float32)
      return [zeros] * len(seeds), [zeros] * len(seeds)
    old_all, ref_all = [], []
    reference = self._reference_params()
    for seeds_B in seeds:
      old = self._score(params, tokens, prompt_lengths, lengths, seeds_B)
      old_all.append(old)
      ref_all.append(old if reference is None else
                     self._score(reference, tokens, prompt_lengths, lengths, seeds_B))
    return old_all, ref_all

  def _reference_params(self):
    if self.reference is None:
      return None
    if self.r.reference_on_host:  # moved onto the mesh for this rollout only
      return jax.tree.map(distributed.from_full_host, self.reference, self.setup.param_shardings)
    return self.reference

  def _score(self, params, tokens, prompt_lengths, lengths, seeds):
    with rules.activation_mesh(self.setup.mesh):
      return distributed.to_host(self.score_fn(params, tokens, prompt_lengths, lengths, seeds))


def make_score_fn(config, model_config):
  """jit(fn(params, tokens, prompt_lengths, lengths, mask_seeds)): the objective's estimate
  (d1: token log-probs [B, L]; ESPO: sequence ELBO [B]) without gradients, params in any dtype."""
  r = config.rl
  common = dict(seed=config.seed, mask_id=config.model.mask_token_id,
                chunk_size=config.model.loss_chunk_tokens)

  def fn(params, tokens, prompt_lengths, lengths, mask_seeds):
    params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    module = model_lib.merge(model_config, params)
    if r.objective == 'd1':
      return estimators.d1_token_logprobs(module, tokens, prompt_lengths, lengths, mask_seeds,
                                          p_mask_prompt=r.p_mask_prompt, **common)
    return estimators.sequence_elbo(module, tokens, prompt_lengths, lengths, mask_seeds,
                                    num_samples=r.elbo_samples, **common)

  return programs.jit_program(fn, model_config.matmul_dtype)


def prompt_template(config) -> str:
  """The chat template of the model RL starts from: 'none' for a pre-trained checkpoint."""
  if not config.init_from:
    return 'none'
  from dlmjax.checkpoint import init_from  # pylint: disable=import-outside-toplevel
  saved = init_from.source_config(config.init_from)
  return 'none' if saved.stage == 'pretrain' else saved.sft.chat_template


@functools.lru_cache(maxsize=4096)
def _chat_prompt(template: str, text: str) -> str:
  from dlmjax.data import chat  # pylint: disable=import-outside-toplevel
  return chat.prompt_text(template, text)


def _safe_correct(task, example, completion) -> bool:
  try:
    return bool(task.is_correct(example, completion))
  except Exception:  # pylint: disable=broad-except
    return False
