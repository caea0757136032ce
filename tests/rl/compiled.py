"""The tiny RL train steps the direction and reference-refresh tests share, compiled once per
objective per test process (a step compiles in tens of seconds on the shared CPU)."""

import functools

import jax

from dlmjax.parallel import mesh as mesh_lib
from dlmjax.rl import rollout
from dlmjax.train import stages
from dlmjax.train import state as state_lib
from dlmjax.train import step as step_lib
from tests.conftest import tiny_test_config

PROMPT, GEN, ROWS = 6, 16, 8
SYNC_EVERY, SYNC_ALPHA = 2, 0.6  # d1's: its reference refreshes after every 2nd step


@functools.cache
def rl_step(objective: str):
  """(config, setup, compiled step, the rollout scorer) of 8 rows = 4 groups of 2 over 2
  micro-batches, prompt 6 + completion 16 tokens. d1 carries a KL term and a refreshed reference
  (rl.ref_sync_every=2) in its state; the others no KL. TraceRL's model is block-causal (blocks
  of 4, decoded one at a time in 2 steps each)."""
  trace = objective == 'trace'
  block = {'model.attention_mask': 'block_causal', 'model.block_size': 4} if trace else {}
  c = tiny_test_config(
    **{
      'rl.objective': objective,
      'stage': 'rl',
      'model.seq_len': 24,
      'train.global_batch_size': ROWS,
      'train.micro_batch_size': 4,
      'train.schedule': 'constant',
      'train.warmup_steps': 0,
      'train.lr': 1e-3,
      'train.weight_decay': 0.0,
      'rl.group_size': 2,
      'rl.max_prompt_tokens': PROMPT,
      'sampler.gen_length': GEN,
      'sampler.block_length': 4 if trace else GEN,
      'sampler.steps': 8 if trace else 4,
      'rl.kl_beta': 0.04 if objective == 'd1' else 0.0,
      'rl.ref_sync_every': SYNC_EVERY if objective == 'd1' else 0,
      'rl.ref_sync_alpha': SYNC_ALPHA,
      'init_from': 'unused: the params are made here',
      **block,
    }
  )
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c, jax.devices()[:1]))
  # The objective's token estimate (SPG's bounds: the direction test computes them itself)
  score = None if objective in ('spg', 'wd1pp') else rollout.make_score_fn(c, setup.model_config)
  return c, setup, step_lib.CompiledStep(setup, stages.build(c)), score
