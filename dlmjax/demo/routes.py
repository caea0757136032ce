"""The demo's stages and routes: each stage's config (configs/demo.py's recipe) chained from the
previous one's run, and the names of the runs and preference pair files of a route."""

from __future__ import annotations

import dataclasses
import os

from dlmjax import config as config_lib
from dlmjax.diffusion import sampling_config
from dlmjax.train import preference_rows

STAGES = ('pretrain', 'sft', 'rl')
# The routes after SFT (--route): RL on the task's reward; VRPO on the task's preference pairs;
# a reward model on those pairs, then RL against it (rl.reward_model). The reward model is no
# generator: it has no table row, its held-out pair accuracy before and after training is
# reported beside the table.
ROUTES = {
  'rl': STAGES,
  'vrpo': ('pretrain', 'sft', 'vrpo'),
  'reward': ('pretrain', 'sft', 'reward', 'rl'),
}
GENERATORS = ('pretrain', 'sft', 'vrpo', 'rl')  # the table's stages, in order


def eval_sampling(rl_config):
  """Greedy decoding with the rollouts' sampler settings (canvas, gen length, steps, blocks)."""
  return dataclasses.replace(sampling_config.SamplingConfig.from_config(rl_config), temperature=0.0)


def configs_dir() -> str:
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  return os.path.join(root, 'configs')


def base_config(path: str, overrides: dict):
  """The config file at `path` with dotted `overrides` on top (configs/demo.py's stages)."""
  return config_lib.apply_overrides(config_lib.load_file(path), overrides)


def config_spec(stage: str, task: str, objective: str = 'd1') -> str:
  """The config file and argument of one demo stage: configs/demo.py:STAGE,TASK,OBJECTIVE."""
  return f'{os.path.join(configs_dir(), "demo.py")}:{stage},{task},{objective}'


def route_stages(route: str) -> tuple[str, ...]:
  """The stages of a route (ROUTES), refusing an unknown one in one line."""
  if route not in ROUTES:
    raise ValueError(f'--route {route!r}: choose one of {sorted(ROUTES)}.')
  return ROUTES[route]


def stage_configs(
  seed: int, run_dir: str, task: str, objective: str = 'd1', route: str = 'rl', pairs: str = 'other'
) -> dict:
  """The stage configs of one seed and route (configs/demo.py's recipe): OUTPUT/seedN/{pretrain,
  sft, ...}, each after SFT from SFT; another objective's RL stage is OUTPUT/seedN/rl_<objective>,
  RL against the reward model rl_reward_model[_<objective>] (its rl.reward_model the seed's
  reward run). The preference stages read the task's pairs of kind `pairs` (write_pair_sets);
  a kind other than the default suffixes their run directories (vrpo_near_miss, ...)."""
  if not os.path.isdir(configs_dir()):
    raise FileNotFoundError(
      f'{configs_dir()} does not exist: the demo builds on the '
      "repository's configs/; run it from a source checkout of dlmjax."
    )
  stages = route_stages(route)
  suffix = pairs_suffix(pairs)
  rl_name = 'rl' if objective == 'd1' else f'rl_{objective}'
  if route == 'reward':
    rl_name = 'rl_reward_model' + ('' if objective == 'd1' else f'_{objective}') + suffix
  configs = {}
  for stage in stages:
    c = config_lib.load_file(config_spec(stage, task, objective))
    c.seed = seed
    name = stage + (suffix if stage in ('vrpo', 'reward') else '')
    c.output_dir = os.path.join(run_dir, rl_name if stage == 'rl' else name)
    c.log.outputs = ''
    if stage == 'sft':
      c.init_from = configs['pretrain'].output_dir
      c.sft.train_file = os.path.join(run_dir, f'sft_{task}.jsonl')
    elif stage != 'pretrain':
      c.init_from = configs['sft'].output_dir
    if stage in ('vrpo', 'reward'):
      c.preference.train_file, c.preference.eval_file = pair_files(run_dir, task, pairs)
    if stage == 'rl' and 'reward' in configs:
      c.rl.reward_model = configs['reward'].output_dir
    configs[stage] = c
  return configs


def pairs_suffix(pairs: str) -> str:
  """'' for the default pair kind, '_KIND' for another (its files' and runs' names)."""
  if pairs not in preference_rows.PAIR_KINDS:
    raise ValueError(f'--pairs {pairs!r}: choose one of {preference_rows.PAIR_KINDS}.')
  return '' if pairs == preference_rows.PAIR_KINDS[0] else f'_{pairs}'


def pair_files(run_dir: str, task: str, pairs: str = 'other') -> tuple[str, str]:
  """(train, held-out) preference pair files of a seed's run directory."""
  name = f'pairs_{task}{pairs_suffix(pairs)}'
  return tuple(os.path.join(run_dir, f'{name}_{split}.jsonl') for split in ('train', 'test'))
