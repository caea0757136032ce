"""The rollout sampler: completions of prompts by the diffusion sampler over the run's mesh.

The params are an argument of every call, so a rollout samples exactly the params it is given
(the train loop passes those of the step about to run).
"""

from __future__ import annotations

import dataclasses


from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config
from dlmjax.parallel import distributed


class RolloutSampler:
  """Samples with `sampling` (greedy=True: the same settings at temperature 0); with_steps,
  generate also returns each generated token's commit step (TraceRL's trajectory); with
  with_predictions, the commit steps and every step's predicted completion (wd1++)."""

  def __init__(
    self,
    config,
    setup,
    tokenizer,
    sampling: sampling_config.SamplingConfig,
    greedy: bool = False,
    with_steps: bool = False,
    with_predictions: bool = False,
  ):
    m = config.model
    if greedy:
      sampling = dataclasses.replace(sampling, temperature=0.0)
    self.sampling, self.tokenizer = sampling, tokenizer
    self.prompt_width = config.rl.max_prompt_tokens
    self.pad_id, self.eos_id = m.pad_token_id, m.eos_token_id
    self._generate = sampler_programs.make_generate_fn(
      setup.model_config,
      sampling,
      mask_id=m.mask_token_id,
      eos_id=m.eos_token_id,
      pad_id=m.pad_token_id,
      mesh=setup.mesh,
      vocab_size=m.vocab_size,
      with_steps=with_steps,
      with_predictions=with_predictions,
    )

  def pad(self, token_ids: list[list[int]]):
    """(prompt_BP, prompt_lengths_B): prompts left-padded to rl.max_prompt_tokens."""
    return prompt_rows.pad_prompts(token_ids, self.pad_id, width=self.prompt_width)

  def generate(self, params, prompt_BP, prompt_lengths_B, key):
    """int32 [B, prompt width + gen_length] on the host: prompts and their completions (with
    with_steps, and int32 [B, gen_length]: each completion token's commit step; with_predictions,
    also int32 [B, steps, gen_length]: each step's predicted completion)."""
    out = self._generate(params, prompt_BP, prompt_lengths_B, key)
    return (
      tuple(map(distributed.to_host, out)) if isinstance(out, tuple) else distributed.to_host(out)
    )

  def texts(self, out_BW) -> list[str]:
    """The completion texts (up to the first EOS) of generate's rows."""
    return [
      self.tokenizer.decode(c)
      for c in prompt_rows.completions(out_BW, self.prompt_width, self.eos_id)
    ]
