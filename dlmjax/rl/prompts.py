"""RL prompts: a task's problems rendered with the start model's chat template and tokenised.

Rollouts draw from the training set (rl.num_prompts problems of the task's train split); the
held-out evaluation reads the test split, or train-split problems outside the training set.
Prompts longer than rl.max_prompt_tokens are dropped, never cut.
"""

from __future__ import annotations

import dataclasses

from dlmjax.checkpoint import init_from
from dlmjax.data import chat
from dlmjax.rl import choices

HELD_OUT_SPLITS = choices.HELD_OUT_SPLITS  # rl.eval_split


@dataclasses.dataclass(frozen=True)
class PromptSet:
  examples: list  # dlmjax.tasks.Example, one per prompt
  token_ids: list[list[int]]


def prompt_template(config) -> str:
  """The chat template of the model RL starts from: 'none' for a pre-trained checkpoint."""
  if not config.init_from:
    return 'none'
  return chat.checkpoint_template(init_from.source_config(config.init_from))


class Prompts:
  """The run's prompt sets, tokenised with its tokenizer and the start model's template."""

  def __init__(self, config, task, tokenizer):
    if getattr(task, 'infill', False):
      raise ValueError(
        f'rl.task={task.name} fills holes (an evaluation: python -m dlmjax.evaluate tasks); RL '
        'samples completions after a prompt: use rl.task=humaneval.'
      )
    self.config, self.task, self.tokenizer = config, task, tokenizer
    self.template = prompt_template(config)
    self.training = self.encode('train', config.rl.num_prompts, config.seed)

  def encode(self, split: str, num: int, seed: int, examples=None) -> PromptSet:
    """The split's examples (or `examples`) whose templated prompt fits rl.max_prompt_tokens."""
    r = self.config.rl
    examples = self.task.examples(split, num, seed) if examples is None else examples
    texts = [chat.prompt_text(self.template, e.prompt) for e in examples]
    ids = self.tokenizer.encode_batch(texts)
    kept = [(e, t) for e, t in zip(examples, ids) if 0 < len(t) <= r.max_prompt_tokens]
    if not kept:
      raise ValueError(
        f'task {r.task}: no {split} prompt fits rl.max_prompt_tokens='
        f'{r.max_prompt_tokens} (asked for {num}); raise rl.max_prompt_tokens.'
      )
    return PromptSet([e for e, _ in kept], [t for _, t in kept])

  def held_out(self, split: str, num: int, seed: int) -> PromptSet:
    """`num` problems of the test split, or for split 'valid' train-split problems that are not
    training prompts."""
    if split == 'test':
      return self.encode('test', num, seed)
    if split != 'valid':
      raise ValueError(f'held-out split {split!r}: choose test or valid.')
    used = {e.prompt for e in self.training.examples}
    try:  # a prefix-stable draw: enough to skip every RL prompt even with the same seed
      drawn = self.task.examples('train', num + len(used), seed)
    except ValueError as e:
      raise ValueError(
        f'rl.eval_split=valid needs {num} train problems besides the '
        f'{len(used)} RL prompts ({e}); lower rl.num_prompts or eval.batches, or '
        'use rl.eval_split=test.'
      ) from None
    return self.encode('train', num, seed, [e for e in drawn if e.prompt not in used][:num])
