"""The three-stage demo (python -m dlmjax.demo): pre-train -> SFT -> RL, VRPO or a reward model on
the tiny model, per seed, each stage scored held-out.

One concept per module, each importing only those above it: routes (the stage configs and
routes), sets (the SFT rows and preference pairs), runs (one seed's stages, their scoring),
distill_stage (the --distill fourth stage), tables (the results over seeds), command (the CLI).
The names below are what the benchmarks, scripts and tests use.
"""

from dlmjax.demo.command import main, parse_seeds
from dlmjax.demo.distill_stage import (
  DISTILL_RECIPE,
  decoding_rows,
  distill_config,
  run_distill,
  write_teacher_rows,
)
from dlmjax.demo.routes import (
  ROUTES,
  STAGES,
  base_config,
  configs_dir,
  eval_sampling,
  pair_files,
  pairs_suffix,
  stage_configs,
)
from dlmjax.demo.runs import (
  best_checkpoint,
  evaluate_stage,
  final_loss,
  metric_rows,
  reward_model_accuracy,
  run_seed,
)
from dlmjax.demo.sets import EVAL_EXAMPLES, SFT_EXAMPLES, write_pair_sets, write_sft_set
from dlmjax.demo.tables import aggregate, format_table

__all__ = [
  'DISTILL_RECIPE',
  'EVAL_EXAMPLES',
  'ROUTES',
  'SFT_EXAMPLES',
  'STAGES',
  'aggregate',
  'base_config',
  'best_checkpoint',
  'configs_dir',
  'decoding_rows',
  'distill_config',
  'eval_sampling',
  'evaluate_stage',
  'final_loss',
  'format_table',
  'main',
  'metric_rows',
  'pair_files',
  'pairs_suffix',
  'parse_seeds',
  'reward_model_accuracy',
  'run_distill',
  'run_seed',
  'stage_configs',
  'write_pair_sets',
  'write_sft_set',
  'write_teacher_rows',
]
