"""A learned reward: a reward model's Bradley-Terry loss on preference pairs, and its scores as an
RL reward (rl.reward_model).

The model is a language model whose output head is replaced by a scalar score head
(ModelConfig.score_head, model/score_head.py), read on the clean sequence at the last token that
is not padding, as transformers' *ForSequenceClassification reads it. Its rows are those of the
preference pairs: prompt + response + EOS, EOS-padded (train/preference_rows.py), so EOS is the
padding the pooling skips (and an export's config.json names EOS its pad_token_id).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from dlmjax import config as config_lib
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_io, hub, run_model
from dlmjax.model import programs
from dlmjax.parallel import distributed, rules
from dlmjax.rl import canvas


def bradley_terry(chosen_B, rejected_B):
  """(loss [B], margin [B]): -log sigmoid(r_chosen - r_rejected) and r_chosen - r_rejected."""
  margin_B = chosen_B - rejected_B
  return -jax.nn.log_sigmoid(margin_B), margin_B


def pair_scores(module, chosen_BL, rejected_BL, pad_id: int):
  """(r(chosen) [B], r(rejected) [B]) in one forward of the 2B rows."""
  both = module.scores(jnp.concatenate([chosen_BL, rejected_BL]), pad_id)
  return jnp.split(both, 2)


@functools.lru_cache(maxsize=8)  # one compilation per model, whatever the run
def score_program(model_config, pad_id: int):
  """jitted (params, tokens [B, L]) -> scores [B] float32, params in any float dtype."""

  def fn(params, tokens):
    params = programs.as_float32_params(params, model_config.matmul_dtype)
    return model_lib.merge(model_config, params).scores(tokens, pad_id)

  return programs.jit_program(fn, model_config.matmul_dtype)


def _load(path: str, mesh):
  """(config, params on the mesh) of a run or step directory, or of a Hugging Face directory
  (a *ForSequenceClassification imports as a reward model: checkpoint/hf_config.py)."""
  if hf_io.is_hf_dir(path):
    config, params = hf_io.load_hf(path)
    return config, jax.device_put(params, model_lib.param_placement(config, mesh)[1])
  loaded = run_model.restore(path, mesh)
  return loaded.config, loaded.params


class RewardModel:
  """A reward run's model (rl.reward_model: its run or step directory) scoring RL completions on
  the run's mesh, in batches of the rollout's rows, beside the policy's old and reference
  log-probs."""

  def __init__(self, path: str, mesh=None, *, policy=None):
    """policy: the RL run's config, whose token ids the reward model must share."""
    if not os.path.isdir(hub.resolve(path)):
      raise config_lib.ConfigError(
        f'rl.reward_model={path!r} is not a directory; set it to the run directory of a '
        '`python -m dlmjax.train --config=configs/reward.py` run, or a Hugging Face '
        '*ForSequenceClassification directory.'
      )
    config, params = _load(hub.resolve(path), mesh)
    if not model_lib.ModelConfig.from_config(config).score_head:
      raise config_lib.ConfigError(
        f'rl.reward_model={path!r} is a language model (a token head, no score head), not a '
        'reward model; set it to '
        'the run directory of a `python -m dlmjax.train --config=configs/reward.py` run, or a '
        'Hugging Face *ForSequenceClassification directory.'
      )
    ids = ('vocab_size', 'eos_token_id')
    if policy is not None and any(config.model[k] != policy.model[k] for k in ids):
      raise config_lib.ConfigError(
        f'rl.reward_model={path!r} reads other token ids than the policy (model.vocab_size, '
        'model.eos_token_id differ); train the reward model from the same tokenizer.'
      )
    self.config, self.params, self.mesh = config, params, mesh
    self.eos_id = config.model.eos_token_id
    self.width = config.model.seq_len
    self.program = score_program(model_lib.ModelConfig.from_config(config), self.eos_id)

  def rows(self, out_BW, prompt_lengths_B, prompt_width: int):
    """The sampler's rows (left-padded prompt + completion) as the reward model's training rows:
    prompt + completion up to its first EOS, EOS after it, to the model's seq_len (cut on the
    right when longer)."""
    tokens, _, _ = canvas.to_right_padded(
      out_BW, prompt_lengths_B, prompt_width, eos_id=self.eos_id, pad_id=self.eos_id
    )
    rows = np.full((tokens.shape[0], self.width), self.eos_id, np.int32)
    keep = min(self.width, tokens.shape[1])
    rows[:, :keep] = tokens[:, :keep]
    return rows

  def __call__(self, rows_SL, batch_size: int) -> np.ndarray:
    """float32 [S] scores of token rows [S, seq_len], batch_size rows per forward (one compiled
    shape: the last batch is padded with copies of the first row)."""
    out = []
    for start in range(0, len(rows_SL), batch_size):
      rows = rows_SL[start : start + batch_size]
      filled = np.concatenate([rows, np.repeat(rows[:1], batch_size - len(rows), axis=0)])
      with rules.activation_mesh(self.mesh):
        scores = distributed.to_host(self.program(self.params, filled))
      out.append(np.asarray(scores, np.float32)[: len(rows)])
    return np.concatenate(out)
