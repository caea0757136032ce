"""RL's held-out evaluation: mean reward and accuracy of greedy completions of fixed problems.

The rollouts' own reward is measured on fresh training prompts each time, so it tracks the
prompt draw as much as the model (docs/benchmarks.md, RL diagnosis); this one scores the same
eval.batches x train.global_batch_size problems of rl.task at every evaluation (rl.eval_split:
the test split, or train-split problems outside the RL prompts; config.EVAL_SEED picks them),
decoded with the rollouts' sampler settings at temperature 0, so it moves only when the model
does.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from dlmjax import config as config_lib
from dlmjax.diffusion import sampling_config
from dlmjax.rl import rollout as rollout_lib
from dlmjax.rl import sampler as rl_sampler


class HeldOutReward:
  """The RL stage's Evaluator."""

  def __init__(self, config, setup, prompts):
    self.config, self.prompts = config, prompts
    self.num = config.eval.batches * config.train.global_batch_size
    self.sampler = rl_sampler.RolloutSampler(
      config,
      setup,
      prompts.tokenizer,
      sampling_config.SamplingConfig.from_config(config),
      greedy=True,
    )
    self._held_out = {}  # (split, num, seed) -> PromptSet, built on first use

  def completions(self, params, num: int, seed: int, split: str = 'test'):
    """(examples, greedy completion texts) of `num` held-out problems whose prompt fits. Every
    process decodes the same global batches, as in a rollout."""
    if (split, num, seed) not in self._held_out:
      self._held_out[split, num, seed] = self.prompts.held_out(split, num, seed)
    held_out = self._held_out[split, num, seed]
    rows, texts = self.config.train.global_batch_size, []
    for start in range(0, len(held_out.examples), rows):
      chunk = held_out.token_ids[start : start + rows]
      chunk = chunk + [chunk[0]] * (rows - len(chunk))  # a full global batch; extras dropped
      prompt_BP, prompt_lengths = self.sampler.pad(chunk)
      key = jax.random.fold_in(jax.random.key(seed), start)  # unused at temperature 0
      texts += self.sampler.texts(self.sampler.generate(params, prompt_BP, prompt_lengths, key))
    return held_out.examples, texts[: len(held_out.examples)]

  def reward(self, params, num: int, seed: int, split: str = 'test') -> dict:
    """Mean reward and accuracy of greedy completions of `num` held-out problems."""
    examples, texts = self.completions(params, num, seed, split)
    rewards, failures, correct, counters = rollout_lib.score_texts(
      self.prompts.task, examples, texts
    )
    return dict(
      val_reward=float(rewards.mean()),
      val_accuracy=float(np.mean(correct)),
      val_examples=len(examples),
      val_reward_failures=failures,
      **{f'val_{k}': v for k, v in counters.items()},
    )

  def run(self, step: int, params) -> dict[str, float]:
    """The row {'step', 'val_reward', 'val_accuracy', ...} for metrics.jsonl; prints a line."""
    jax.block_until_ready(params)
    start = time.time()
    row = {
      'step': step,
      **self.reward(params, self.num, config_lib.EVAL_SEED, self.config.rl.eval_split),
    }
    if jax.process_index() == 0:
      print(
        f'step {step}: val_reward {row["val_reward"]:.4f} | val_accuracy '
        f'{row["val_accuracy"]:.4f} ({row["val_examples"]} held-out problems, '
        f'{time.time() - start:.1f}s)',
        flush=True,
      )
    return row
