"""Keys this version no longer has: the one line naming their replacement, and the mapping that
keeps a saved run's config.json (written by an older version) loadable."""

from __future__ import annotations

import ml_collections

from dlmjax.config import schema
from dlmjax.config.keys import flatten, get_key, parent

# Keys this version no longer has: old name -> the new key, or why it went. A command-line
# override or a config file setting one fails naming this; a saved run's config.json maps the
# renamed ones (from_dict).
RENAMED = {
  'rl.gen_length': 'sampler.gen_length',
  'rl.diffusion_steps': 'sampler.steps',
  'rl.block_length': 'sampler.block_length',
  'rl.temperature': 'sampler.temperature',
  'sft.packing': 'data.packing',
  # MoE: one group, model.moe.* (docs/moe.md).
  'model.num_experts': 'model.moe.num_experts',
  'model.experts_per_token': 'model.moe.experts_per_token',
  'model.moe_ffn_dim': 'model.moe.ffn_dim',
  'model.shared_experts': 'model.moe.shared_experts',
  'model.router': 'model.moe.router',
  'model.dense_layers': 'model.moe.dense_layers',
  'model.moe_backend': 'model.moe.backend',
  'model.moe_exchange': 'model.moe.exchange',
  'model.router_groups': 'model.moe.router_groups',
  'model.router_group_topk': 'model.moe.router_group_topk',
  'model.routed_scale': 'model.moe.routed_scale',
  'train.moe_balance_loss': 'model.moe.balance_loss',
  'train.moe_z_loss': 'model.moe.z_loss',
  'train.moe_bias_rate': 'model.moe.bias_rate',
}
REMOVED = {
  'rl.advantage_scaling': 'advantages are r - group mean (std scaling: a parameter of '
  'dlmjax/rl/advantages.py)',
  'rl.negative_advantages': 'every advantage is kept (dropping negatives: a parameter of '
  'dlmjax/rl/advantages.py)',
  'rl.loss_normalisation': "the loss is a token mean over the batch (GRPO's per sequence: a "
  'parameter of dlmjax/rl/rollout.py loss_weights)',
  'rl.kl_reference': 'the KL reference is the init model; rl.kl_beta=0 turns the KL off',
  'sft.supervise_padding': 'EOS padding is supervised unless data.packing=True',
  'sft.normalisation': "LLaDA's per-answer-length normalisation (others: a parameter of "
  'dlmjax/diffusion/sft_loss.py)',
  'sft.weight_by_inverse_t': "LLaDA's 1/p weight (a parameter of dlmjax/diffusion/sft_loss.py)",
  'sft.time_eps': "LLaDA's 1e-3 (a parameter of dlmjax/diffusion/sft_loss.py)",
  'log.tensorboard': 'use log.outputs (comma-separated: tensorboard,wandb,plots)',
  'log.wandb': 'use log.outputs (comma-separated: tensorboard,wandb,plots)',
  'log.plots': 'use log.outputs (comma-separated: tensorboard,wandb,plots)',
  'log.wandb_project': 'wandb reads the WANDB_PROJECT environment variable',
  'log.peak_tflops': "MFU uses the device kind's peak (dlmjax/train/reporting.py)",
  'model.preset': 'config files apply presets with dlmjax.model.presets.apply_preset; the '
  'command line takes --config.model.preset=NAME',
  'model.vocab_multiple': 'the embedding pads to config.VOCAB_MULTIPLE (128, Megatron)',
  'data.tfds_data_dir': 'TFDS reads the TFDS_DATA_DIR environment variable',
  'checkpoint.async_save': 'checkpoints are always saved asynchronously',
  'train.eps': "AdamW's epsilon is 1e-8 (dlmjax/train/optimizer.py)",
  'train.b1': "AdamW's beta1 is 0.9 (dlmjax/train/optimizer.py); beta2 stays train.b2",
  'train.wsd_decay_style': 'the anneal is part of train.schedule: wsd (exponential) | '
  'wsd_linear | wsd_cosine',
  'eval.seed': 'evaluation masks and problems come from a fixed seed (dlmjax/train/evaluation.py)',
}


def old_key_message(dotted: str) -> str | None:
  """The one line telling a user of an old key what replaced it, or None for other keys."""
  if dotted in RENAMED:
    return f'{dotted} is now {RENAMED[dotted]}.'
  if dotted in REMOVED:
    return f'{dotted} is no longer a key: {REMOVED[dotted]}.'
  return None


def from_dict(values: dict) -> ml_collections.ConfigDict:
  """The defaults updated with saved values (a run's config.json): renamed keys map to their new
  names, keys this version no longer has are ignored, so old run directories stay loadable."""
  values = flatten(values)
  if values.get('sft.packing'):
    values['data.packing'] = True
  style = values.get('train.wsd_decay_style', 'exponential')
  if values.get('train.schedule') == 'wsd' and style != 'exponential':
    values['train.schedule'] = f'wsd_{style}'
  outputs = [name for name in ('tensorboard', 'wandb', 'plots') if values.get(f'log.{name}')]
  if any(f'log.{name}' in values for name in ('tensorboard', 'wandb', 'plots')):
    values['log.outputs'] = ','.join(outputs)
  for old, new in RENAMED.items():
    if old in values and old != 'sft.packing':
      values.setdefault(new, values[old])
  config = schema.defaults()
  for dotted, value in values.items():
    try:
      default = get_key(config, dotted)
    except (KeyError, TypeError):
      continue
    if isinstance(default, ml_collections.ConfigDict):
      continue
    node, leaf = parent(config, dotted)
    node[leaf] = type(default)(value) if default is not None else value
  return config
