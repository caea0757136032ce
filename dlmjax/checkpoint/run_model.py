"""Any run's weights as one model: a full run's params, or a LoRA run's adapters joined to the
base it trained on.

A LoRA run's steps hold the adapters alone; its base is what `<run>/lora_base.json` names (the
run's init_from), restored the way init_from restores it and checked against the checksum the
run recorded (checkpoint/lora_checkpoint.py). The two come back either merged, W + (alpha / r) A B
in float32, a plain model with train.lora.rank 0 (the default: what `convert to-hf` exports), or
side by side as the run's own forward computes them (the base in its frozen storage, int8/NF4
included, and the adapters beside it).

Every entry point that reads a run goes through here: load_pretrained (so generate, evaluate and
the server), verify, convert and init_from (so a LoRA run can start another run: SFT, RL, a new
LoRA, a full fine-tune of the merged model).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from dlmjax import model as model_lib
from dlmjax.checkpoint import compatibility
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import hub
from dlmjax.checkpoint import lora_checkpoint
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.model import lora, score_head
from dlmjax.parallel import rules


@dataclasses.dataclass
class RunModel:
  """A run's step as a model: `config` and `model_config` describe exactly `params`."""

  config: ml_collections.ConfigDict
  model_config: model_lib.ModelConfig
  params: dict
  step_dir: str
  step: int


def is_lora_run(path: str) -> bool:
  """Whether a run or step directory belongs to a LoRA run (its checkpoints hold adapters)."""
  run_dir, _, _ = run_dir_lib.resolve_step_dir(path)
  return lora.is_lora_run(run_dir_lib.load_run_config(run_dir))


def restore(path: str, mesh=None, *, merge_lora: bool = True) -> RunModel:
  """The model of a run directory (its latest step) or step directory, on one device or in the
  mesh's shardings. A LoRA run comes back merged into its base (merge_lora) or with its adapters
  beside the frozen base."""
  run_dir, step_dir, step = run_dir_lib.resolve_step_dir(path)
  config = run_dir_lib.load_run_config(run_dir)
  if not lora.is_lora_run(config):
    params = params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config, mesh))
    return RunModel(config, model_lib.ModelConfig.from_config(config), params, step_dir, step)
  cfg, adapters, frozen = restore_lora(run_dir, step_dir, config, mesh)
  if not merge_lora:
    return RunModel(config, cfg, lora.combine(adapters, frozen), step_dir, step)
  plain = config.copy_and_resolve_references()
  plain.train.lora.rank = 0  # the merged weights are a plain model
  merged = lora.merge_into_base(lora.combine(adapters, frozen), cfg.lora_spec)
  params = jax.device_put(merged, model_lib.param_placement(plain, mesh)[1])
  return RunModel(plain, model_lib.ModelConfig.from_config(plain), params, step_dir, step)


def restore_lora(run_dir: str, step_dir: str, config, mesh=None):
  """(ModelConfig with the adapters, adapters, frozen base) of a LoRA run's step. The base is
  refused when it changed since the run trained on it."""
  cfg = lora.with_adapters(model_lib.ModelConfig.from_config(config), config)
  _, shapes, axes = model_lib.abstract(cfg)
  adapter_shapes, base_shapes = lora.split(shapes)
  adapter_axes, frozen_axes = lora.split(axes)
  adapters = params_checkpoint.restore_params(
    step_dir, adapter_shapes, _shardings(adapter_shapes, adapter_axes, mesh)
  )
  recorded = lora_checkpoint.recorded_base(run_dir)
  source = config.copy_and_resolve_references()
  source.init_from = recorded.get('path', config.init_from)
  base = source_params(source, mesh, purpose=None)
  frozen = jax.jit(
    lambda p: lora.freeze(lora.split(p)[1], cfg, lora.storage_dtype(config)),
    out_shardings=_shardings(base_shapes, frozen_axes, mesh),
  )(base)
  if recorded and lora_checkpoint.check_base(recorded, source.init_from, frozen) is not None:
    raise run_dir_lib.CheckpointError(
      f'the LoRA base {source.init_from} changed since {run_dir} trained on it (checksum '
      f'{recorded["checksum"][:12]}); restore that base, or use a run whose base matches.'
    )
  return cfg, adapters, frozen


def source_params(config, mesh=None, purpose: str | None = 'initialising') -> dict:
  """The float params of config.init_from (a Hugging Face directory, a run or a step, a LoRA run
  merged) placed as the config's model in the mesh; the architecture must match the config.
  `purpose` names the use in the printed line (None: nothing printed).

  A reward model (ModelConfig.score_head) started from a language model gets the backbone and a
  fresh score head (model/score_head.py)."""
  path = hub.resolve(config.init_from)
  cfg = model_lib.ModelConfig.from_config(config)
  shapes, shardings = model_lib.param_placement(config, mesh)
  if hf_io.is_hf_dir(path):
    _, params = hf_io.load_hf(path, config=config)  # checks the weights against config
    if cfg.score_head and score_head.KEY not in params:  # a language model: a fresh head
      params = score_head.attach(params, cfg, config.seed)
    return jax.device_put(params, shardings)
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(path)
  saved = run_dir_lib.load_run_config(run_dir)
  if model_lib.ModelConfig.from_config(saved).score_head and not cfg.score_head:
    raise run_dir_lib.CheckpointError(
      f'init_from={config.init_from!r} is a reward model (a score head, no token head): a '
      f'stage={config.stage} run cannot start from it; set --config.init_from to the language '
      f'model it was trained from ({saved.init_from or "its init_from"}).'
    )
  compatibility.check_architecture(saved, config)
  if purpose is not None and jax.process_index() == 0:
    print(f'{purpose} from {step_dir}', flush=True)
  if cfg.score_head and not model_lib.ModelConfig.from_config(saved).score_head:
    language_model = restore(step_dir, mesh).params
    return jax.device_put(score_head.attach(language_model, cfg, config.seed), shardings)
  if is_lora_run(step_dir):
    return jax.device_put(restore(step_dir, mesh).params, shardings)
  return params_checkpoint.restore_params(step_dir, shapes, shardings)


def _shardings(shapes, axes, mesh):
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, shapes)
  return rules.tree_shardings(mesh, axes)
