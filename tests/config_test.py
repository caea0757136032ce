"""Every shipped config loads and validates; bad configs fail with a message naming the fix."""

import ast
import dataclasses
import glob
import os
import re

import pytest

from dlmjax import config as config_lib
from dlmjax.checkpoint import compatibility
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.config import registry, schema
from dlmjax.data import chat
from dlmjax.diffusion import cache_modes, distill, loss, sampling_config, schedules
from dlmjax.kernels import grouped_matmul
from dlmjax.model import attention, layers, moe, transformer
from dlmjax.model.presets import PRESETS, ModelConfig
from dlmjax.rl import config_checks as rl_checks
from dlmjax.rl import objectives, prompts, reference
from dlmjax.train import optimizer, sft_rows, stages
from tests.conftest import tiny_test_config

ROOT = os.path.join(os.path.dirname(__file__), '..')


def _load(path, arg=None):
  return config_lib.load_file(f'{path}:{arg}' if arg else path)


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))))
def test_shipped_configs_validate(path):
  config = _load(path)
  config_lib.validate(config)
  assert set(config.keys()) == set(config_lib.defaults().keys())


def test_pretrain_1p7b_recipe():
  c = _load(os.path.join(ROOT, 'configs', 'pretrain_1p7b.py'))
  assert (c.model.num_layers, c.model.d_model, c.model.ffn_dim, c.model.vocab_size) == (
    28,
    2048,
    6144,
    50289,
  )
  assert config_lib.padded_vocab_size(c) == 50304
  assert (c.train.lr, c.train.min_lr, c.train.warmup_steps, c.train.wsd_decay_steps) == (
    2e-4,
    2e-5,
    2000,
    1000,
  )
  config_lib.validate(_load(os.path.join(ROOT, 'configs', 'pretrain_1p7b.py'), 'smoke'))


def test_tiny_batches_fit_every_8_device_mesh():
  c = _load(os.path.join(ROOT, 'configs', 'tiny.py'))
  config_lib.validate(c, num_devices=8)  # the default: fsdp fills the devices
  for data, fsdp, tensor in ((8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2), (1, 1, 8)):
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
    if c.model.num_heads % tensor == 0:
      config_lib.validate(c, num_devices=8)


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'mesh.tensor': 3}, 'not divisible by mesh.tensor=3'),
    ({'mesh.data': 16, 'mesh.fsdp': 1}, 'only 8 exist'),
    ({'mesh.data': 3}, 'cannot fill 8 devices'),
    ({'mesh.data': -1, 'mesh.fsdp': -1}, 'at most one axis'),
    ({'mesh.data': 2, 'mesh.fsdp': 1}, 'uses 2 of 8 devices'),
    ({'train.micro_batch_size': 6}, 'not a multiple of train.micro_batch_size'),
    (
      {'mesh.data': 8, 'mesh.fsdp': 1, 'train.micro_batch_size': 4, 'train.global_batch_size': 16},
      'not divisible by the batch-parallel devices',
    ),
    ({'model.attention_mask': 'sideways'}, 'model.attention_mask'),
    ({'model.mask_token_id': 99999}, 'outside the vocabulary'),
    ({'model.attention_backend': 'cudnn', 'model.attention_mask': 'block_causal'}, 'xla'),
    ({'diffusion.objective': 'ar'}, 'attention_mask=causal'),
    (
      {'diffusion.objective': 'ar', 'model.attention_mask': 'causal', 'model.shift_logits': True},
      'shift it twice: set --config.model.shift_logits=false',
    ),
    ({'data.packing': True, 'model.attention_backend': 'cudnn'}, 'attention_backend=xla'),
    ({'train.lr': -1.0}, r'train.lr=-1.0 must be > 0'),
    ({'train.min_lr': -1e-4}, r'train.min_lr=-0.0001 >= 0'),
  ],
)
def test_bad_configs_name_the_fix(overrides, message):
  config = tiny_test_config(**overrides)
  devices = 8
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config, num_devices=devices)


def test_short_runs_scale_warmup_and_anneal_to_fit():
  tiny = config_lib.load_file('configs/tiny.py')  # warmup 10 + anneal 24 in 120 steps
  assert config_lib.fit_schedule(tiny) is None
  tiny.train.steps = 5
  note = config_lib.fit_schedule(tiny)
  # In proportion, rounded down: 10 * 5 // 34 = 1 and 24 * 5 // 34 = 3.
  assert (tiny.train.warmup_steps, tiny.train.wsd_decay_steps) == (1, 3)
  assert note.startswith('train.steps=5 is shorter than warmup 10 + anneal 24 steps: scaled')
  assert '--config.train.wsd_decay_steps' in note
  config_lib.validate(tiny, num_devices=1)
  cosine = tiny_test_config(**{'train.schedule': 'cosine', 'train.warmup_steps': 8})
  cosine.train.steps = 4  # cosine has no anneal length: only the warmup shrinks, to the run.
  assert 'scaled to warmup 4 (set' in config_lib.fit_schedule(cosine)
  unfitted = tiny_test_config(**{'train.warmup_steps': 30, 'train.wsd_decay_steps': 30})
  with pytest.raises(config_lib.ConfigError, match='lower --config.train.warmup_steps and'):
    config_lib.validate(unfitted, num_devices=8)


def _num_keys(node):
  return sum(_num_keys(v) if isinstance(v, dict) else 1 for v in node.values())


def test_the_config_has_fewer_than_160_keys():
  # A budget, raised only with a stage: 144 keys before preference (VRPO) and distillation
  # joined the SFT / preference groups; a feature's tuning knobs belong in its code's defaults.
  assert _num_keys(config_lib.defaults().to_dict()) < 160


def test_every_key_has_its_meaning_and_no_comment_cites_an_issue():
  """Each `c.group.key = default` line has a comment on it or in the block just above it."""
  lines = open(schema.__file__).read().split('\n')
  start = next(i for i, line in enumerate(lines) if line.startswith('def defaults('))
  end = next(i for i, line in enumerate(lines) if line.startswith('ARCHITECTURE_KEYS = '))
  body = lines[start:end]
  for i, line in enumerate(body):
    assert not re.search(r'issue \d|\b20\d\d-\d\d', line), line
    if re.match(r'  c\.[a-z_.]+ = ', line) and 'ConfigDict()' not in line:
      above = [b for b in body[max(0, i - 12) : i] if b.strip()]
      commented = '#' in line or any(b.lstrip().startswith('#') for b in above[-6:])
      assert commented, f'no meaning beside {line.strip()}'


def test_config_imports_nothing_of_dlmjax_but_itself():
  """config sits at the bottom of the import graph (every feature validates against it)."""
  for path in glob.glob(os.path.join(os.path.dirname(config_lib.__file__), '*.py')):
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.ImportFrom):
        module = node.module or ''
        assert (
          module == 'dlmjax.config'
          or module.startswith('dlmjax.config.')
          or (not module.startswith('dlmjax'))
        ), (path, module)
      elif isinstance(node, ast.Import):
        assert not any(a.name.startswith('dlmjax') for a in node.names), path


def test_the_registry_names_every_features_checks():
  """A feature's config_checks module is validated only if CHECK_MODULES names it."""
  package = os.path.join(ROOT, 'dlmjax')
  found = {
    os.path.relpath(path, ROOT)[: -len('.py')].replace(os.sep, '.')
    for path in glob.glob(os.path.join(package, '**', 'config_checks.py'), recursive=True)
  }
  assert found == set(registry.CHECK_MODULES)
  assert len(registry.CHECK_MODULES) == len(found)


def test_choice_lists_are_their_owners_tables():
  """Every choice list is read from the feature that dispatches on it (one source)."""
  owners = {
    'stage': stages.BUILDERS,
    'rl.objective': objectives.names(),
    'rl.eval_split': prompts.HELD_OUT_SPLITS,
    'rl.reference_dtype': reference.DTYPES,
    'model.attention_mask': attention.MASKS,
    'model.attention_backend': attention.BACKENDS,
    'model.norm_backend': layers.NORM_BACKENDS,
    'model.dtype': layers.COMPUTE_DTYPES,
    'model.moe.router': moe.ROUTERS,
    'model.moe.backend': grouped_matmul.BACKENDS,
    'model.moe.exchange': moe.EXCHANGES,
    'model.matmul_dtype': layers.MATMUL_DTYPES,
    'model.remat': transformer.REMAT_POLICIES,
    'diffusion.objective': loss.OBJECTIVES,
    'diffusion.block_parameterization': loss.BLOCK_PARAMETERIZATIONS,
    'train.schedule': optimizer.SCHEDULES,
    'sft.chat_template': chat.TEMPLATES,
    'sft.too_long': sft_rows.TOO_LONG,
    'sft.objective': distill.OBJECTIVES,
    'sampler.cache': cache_modes.MODES,
    'sampler.schedule': schedules.SCHEDULES,
  }
  choices = config_lib.registered_choices()
  assert choices == {key: tuple(table) for key, table in owners.items()}
  assert rl_checks.objective_names() == choices['rl.objective']
  for key, names in choices.items():  # each default is one of its choices, each choice named
    assert config_lib.get_key(config_lib.defaults(), key) in names, key
    bad = tiny_test_config()
    parent, _, leaf = key.rpartition('.')
    (config_lib.get_key(bad, parent) if parent else bad)[leaf] = 'no_such_choice'
    with pytest.raises(config_lib.ConfigError, match=re.escape(f"{key}='no_such_choice'")):
      config_lib.validate(bad)


def test_architecture_keys_are_keys_and_resume_compares_them():
  flat = config_lib.get_key  # every declared key exists in the schema
  for key in config_lib.ARCHITECTURE_KEYS + config_lib.STREAM_KEYS:
    flat(config_lib.defaults(), key)
  saved, run = tiny_test_config(), tiny_test_config(**{'model.qkv_bias': True})
  with pytest.raises(run_dir_lib.CheckpointError, match='model.qkv_bias: checkpoint False'):
    compatibility.check_architecture(saved, run)
  # a stream key: resume only
  compatibility.check_architecture(saved, tiny_test_config(**{'seed': 7}))
  with pytest.raises(run_dir_lib.CheckpointError, match='seed: checkpoint'):
    compatibility.check_resumable(saved, tiny_test_config(**{'seed': 7}))


def test_sampler_group_is_the_sampling_config():
  c = config_lib.defaults()
  assert set(c.sampler.keys()) == set(sampling_config.FIELDS)
  settings = sampling_config.SamplingConfig.from_config(c)
  assert dataclasses.asdict(settings) == c.sampler.to_dict()
  # The rollout sampler as it was under rl.*: 64 tokens, 32 steps, blocks of 32, temperature 0.9.
  assert (settings.gen_length, settings.steps, settings.block_length, settings.temperature) == (
    64,
    32,
    32,
    0.9,
  )
  c.sampler.block_length = 5  # from_config validates by itself, naming the group
  with pytest.raises(
    config_lib.ConfigError,
    match='config.sampler: gen_length=64 is not a multiple of block_length=5',
  ):
    sampling_config.SamplingConfig.from_config(c)


@pytest.mark.parametrize(
  'overrides,message',
  [
    (
      {'sampler.block_length': 5},
      'sampler.gen_length=64 is not a multiple of sampler.block_length=5',
    ),
    ({'sampler.steps': 3}, 'sampler.steps=3 is not a multiple of the 2 blocks'),
    ({'sampler.temperature': -1.0}, 'sampler.temperature'),
    ({'sampler.top_p': 0.0}, 'sampler.top_p'),
    ({'sampler.remasking': 'sideways'}, 'sampler.remasking'),
    ({'sampler.cache': 'kv'}, 'sampler.cache'),
    ({'sampler.threshold': 2.0}, 'sampler.threshold'),
    ({'sampler.remasking': 'topk_margin'}, "Dream's topk_margin is closest to 'margin'"),
    ({'sampler.alg_temp': -0.5}, 'sampler.alg_temp=-0.5 must be >= 0'),
    ({'sampler.factor': -1.0}, 'sampler.factor=-1.0 must be >= 0'),
    ({'sampler.threshold': 0.9, 'sampler.factor': 1.0}, 'set one of them to 0'),
    ({'log.outputs': 'tensorboard,slack'}, "names 'slack'"),
    ({'sampler.cache': 'block'}, 'sampler.cache=block is exact only for causal or block_causal'),
  ],
)
def test_bad_sampler_and_log_keys_name_the_key(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
    config_lib.validate(tiny_test_config(**overrides))


def test_rl_cross_checks_the_sampler_canvas():
  c = tiny_test_config(
    **{
      'stage': 'rl',
      'init_from': 'x',
      'model.seq_len': 64,
      'rl.max_prompt_tokens': 32,
      'sampler.gen_length': 32,
      'sampler.block_length': 32,
      'sampler.steps': 4,
      'rl.group_size': 4,
    }
  )
  config_lib.validate(c)
  c.sampler.gen_length = 64
  with pytest.raises(
    config_lib.ConfigError, match=re.escape('rl.max_prompt_tokens + sampler.gen_length = 96 exceed')
  ):
    config_lib.validate(c)


@pytest.mark.parametrize(
  'old,new',
  [
    ('rl.gen_length', 'sampler.gen_length'),
    ('rl.diffusion_steps', 'sampler.steps'),
    ('rl.block_length', 'sampler.block_length'),
    ('rl.temperature', 'sampler.temperature'),
    ('sft.packing', 'data.packing'),
    *((old, new) for old, new in config_lib.RENAMED.items() if new.startswith('model.moe.')),
  ],
)
def test_renamed_keys_fail_naming_the_new_one(old, new, tmp_path):
  expected = f'{old} is now {new}.'
  with pytest.raises(config_lib.ConfigError, match=re.escape(expected)):
    config_lib.apply_overrides(config_lib.defaults(), [f'--config.{old}=1'])
  with pytest.raises(config_lib.ConfigError, match=re.escape(expected)):
    config_lib.apply_overrides(config_lib.defaults(), {old: 1})
  group, leaf = old.split('.')
  path = tmp_path / 'old.py'  # a config file written for the old keys
  path.write_text(
    'from dlmjax import config as config_lib\n\n\n'
    'def get_config():\n'
    '  c = config_lib.defaults()\n'
    f'  c.{group}.{leaf} = 1\n'
    '  return c\n'
  )
  with pytest.raises(config_lib.ConfigError, match=re.escape(f'{path}: {expected}')):
    config_lib.load_file(str(path))


@pytest.mark.parametrize('old', sorted(config_lib.REMOVED))
def test_removed_keys_fail_saying_why(old):
  with pytest.raises(config_lib.ConfigError, match=re.escape(f'{old} is no longer a key: ')):
    config_lib.apply_overrides(config_lib.defaults(), {old: 1})
  assert old not in config_lib.RENAMED


def test_old_run_configs_still_load():
  """A config.json written before the renames: the renamed keys map, the dropped ones go."""
  saved = config_lib.defaults().to_dict()
  del saved['sampler']
  saved['rl'].update(
    gen_length=16,
    diffusion_steps=4,
    block_length=8,
    temperature=0.7,
    advantage_scaling='std',
    negative_advantages='drop',
  )
  saved['sft'].update(packing=True, supervise_padding=False, time_eps=1e-3)
  saved['log'] = dict(
    every=5, tensorboard=False, wandb=True, wandb_project='p', plots=True, peak_tflops=0.0
  )
  saved['train'].update(schedule='wsd', wsd_decay_style='linear', b1=0.9, eps=1e-8)
  saved['model'].update(preset='tiny', vocab_multiple=128)
  del saved['model']['moe']  # an MoE run from before model.moe.*: its keys flat in model, train
  saved['model'].update(
    num_experts=8,
    experts_per_token=2,
    moe_ffn_dim=48,
    shared_experts=1,
    router='sigmoid_bias',
    router_groups=4,
    router_group_topk=2,
    routed_scale=2.5,
    dense_layers='0',
    moe_backend='xla',
    moe_exchange='all_to_all',
  )
  saved['train'].update(moe_balance_loss=0.01, moe_z_loss=0.001, moe_bias_rate=0.002)
  c = config_lib.from_dict(saved)
  assert c.model.moe.to_dict() == dict(
    num_experts=8,
    experts_per_token=2,
    ffn_dim=48,
    shared_experts=1,
    router='sigmoid_bias',
    router_groups=4,
    router_group_topk=2,
    routed_scale=2.5,
    block_experts=0,  # a later key: its default
    dense_layers='0',
    backend='xla',
    exchange='all_to_all',
    balance_loss=0.01,
    z_loss=0.001,
    bias_rate=0.002,
  )
  assert (c.sampler.gen_length, c.sampler.steps, c.sampler.block_length, c.sampler.temperature) == (
    16,
    4,
    8,
    0.7,
  )
  assert c.data.packing and c.log.every == 5 and c.log.outputs == 'wandb,plots'
  assert c.train.schedule == 'wsd_linear'
  assert 'advantage_scaling' not in c.rl and 'preset' not in c.model
  assert 'num_experts' not in c.model and 'moe_balance_loss' not in c.train
  config_lib.check_keys(c)  # nothing old left
  assert config_lib.from_dict(config_lib.defaults().to_dict()).to_dict() == (
    config_lib.defaults().to_dict()
  )


def test_load_file_takes_an_argument_and_names_a_bad_file(tmp_path):
  c = config_lib.load_file(os.path.join(ROOT, 'configs', 'rl.py:spg'))
  assert c.rl.objective == 'spg' and c.rl.kl_beta == 0.0
  with pytest.raises(
    config_lib.ConfigError, match='cannot load the --config file .*missing.py: it does not exist'
  ):
    config_lib.load_file(str(tmp_path / 'missing.py'))
  with pytest.raises(config_lib.ConfigError, match='ValueError: configs/rl.py takes no argument'):
    config_lib.load_file(os.path.join(ROOT, 'configs', 'rl.py:ppo'))
  typo = tmp_path / 'typo.py'
  typo.write_text(
    'from dlmjax import config as config_lib\n\n\ndef get_config():\n'
    '  c = config_lib.defaults()\n  c.train.stpes = 3\n  return c\n'
  )
  with pytest.raises(config_lib.ConfigError, match='train.stpes is not a config key'):
    config_lib.load_file(str(typo))


def test_apply_overrides_parses_as_the_default_type():
  c = config_lib.apply_overrides(
    config_lib.defaults(),
    [
      '--config.train.lr=1e-4',
      '--config.train.steps=1e3',
      'data.packing=true',
      '--config.model.dtype=bfloat16',
      '--config.sampler.stop_at_eos=False',
      '--config.log.outputs=',
    ],
  )
  assert (c.train.lr, c.train.steps, c.data.packing, c.model.dtype) == (
    1e-4,
    1000,
    True,
    'bfloat16',
  )
  assert c.sampler.stop_at_eos is False and c.log.outputs == ''
  assert isinstance(c.train.steps, int) and isinstance(c.train.lr, float)
  config_lib.apply_overrides(c, {'train.lr': 1, 'rl.kl_beta': 0})  # ints where floats live
  assert isinstance(c.train.lr, float) and c.train.lr == 1.0
  for overrides, message in (
    (['--config.model.d_modle=3'], 'Did you mean "d_model"'),
    (['--config.model.d_model=abc'], 'invalid literal'),
    (['--config.train.steps=2.5'], 'is not an integer'),
    (['--config.data.packing=maybe'], 'is not a bool'),
    (['--config.model=3'], 'model is a group'),
    (['--config.train.steps'], 'is not KEY=VALUE'),
    ({'model.dtype': 3}, 'is not a str'),
    ({'train.steps': 2.5}, 'is not an integer'),
  ):
    with pytest.raises(config_lib.ConfigError, match=re.escape(message)):
      config_lib.apply_overrides(config_lib.defaults(), overrides)


def test_parse_command_line_splits_config_flags_from_the_rest():
  argv = [
    'prog',
    '--devices=8',
    f'--config={ROOT}/configs/rl.py:espo',
    '--config.train.steps',
    '7',
    '--compile',
    '--config.sampler.temperature=0.5',
  ]
  c, rest = config_lib.parse_command_line(argv, 'configs/tiny.py')
  assert rest == ['prog', '--devices=8', '--compile']
  assert (c.rl.objective, c.train.steps, c.sampler.temperature) == ('espo', 7, 0.5)


def test_rope_scaling_is_parsed_and_bad_values_fail_in_one_line():
  config = config_lib.defaults()
  text = (
    'llama3:factor=8,low_freq_factor=1,high_freq_factor=4,original_max_position_embeddings=8192'
  )
  config.model.rope_scaling = text
  config_lib.validate(config, num_devices=1)
  kind, fields = config_lib.parse_rope_scaling(text)
  assert config_lib.format_rope_scaling(kind, fields) == text
  for bad, says in (
    ('yarn:factor=4', "unknown type 'yarn'"),
    ('linear:factor=x', "'factor=x' is not field=number"),
    ('llama3:factor=8', 'llama3 takes exactly'),
  ):
    config.model.rope_scaling = bad
    with pytest.raises(config_lib.ConfigError, match=says) as e:
      config_lib.validate(config, num_devices=1)
    assert '\n' not in str(e.value) and 'model.rope_scaling' in str(e.value)


def test_presets_and_model_fields_reach_the_moe_group():
  """A preset (the model's field names) sets model.moe.*; model_field reads it back."""
  c = config_lib.apply_overrides(config_lib.defaults(), {'model.preset': 'tiny_moe'}, PRESETS)
  assert (c.model.moe.num_experts, c.model.moe.ffn_dim) == (8, 192)
  assert config_lib.model_field(c.model, 'moe_ffn_dim') == 192
  assert config_lib.model_field(c.model, 'd_model') == c.model.d_model
  model = ModelConfig.from_config(c)
  assert (model.num_experts, model.moe_ffn_dim, model.router) == (8, 192, 'softmax_topk')
