"""The summary CLI (and the shared CLI error handling): counts, and one-line errors with exit 2."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), '..')


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='')
  return subprocess.run(
    [sys.executable, '-m', 'dlmjax.summary', *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


def test_pretrain_1p7b_counts():
  result = _run(
    '--config=configs/pretrain_1p7b.py',
    '--devices=8',
    '--config.mesh.fsdp=8',
    '--config.train.micro_batch_size=32',
  )
  assert result.returncode == 0, result.stderr
  assert '1,732,895,744' in result.stdout and '1,732,834,304' in result.stdout
  assert 'FLOPs per token (train): 1.1189e+10' in result.stdout


@pytest.mark.parametrize(
  'args,message',
  [
    (['--config.model.d_modle=3'], 'Did you mean "d_model"'),
    (['--config.model.d_model=abc'], 'invalid literal'),
    (['--config.mesh.tensor=3'], 'not divisible by mesh.tensor=3'),
    (['--config=configs/missing.py'], 'cannot load the --config file'),
    (['--config.rl.gen_length=64'], 'rl.gen_length is now sampler.gen_length.'),
  ],
)
def test_bad_input_is_one_line(args, message):
  result = _run(*(args if args[0].startswith('--config=') else ['--config=configs/tiny.py', *args]))
  assert result.returncode == 2
  assert message in result.stderr
  assert 'Traceback' not in result.stderr


# Every preset's published parameter count (the sources are in dlmjax/config/presets.py beside each
# entry): the embedding as the checkpoint stores it, a tied head counted once.
PUBLISHED = {
  '1p7b': 1_732_895_744,  # MegaDLMs 1.7B, vocab padded to 50304 (test_pretrain_1p7b_counts)
  'qwen2p5_0p5b': 494_032_768,  # Qwen2.5 model card 0.49B
  'qwen2p5_7b': 7_615_616_512,  # Qwen2.5 model card 7.61B
  'dream_7b': 7_615_616_512,  # Dream-v0-7B: Qwen2.5-7B's shape (model card 7.62B)
  'qwen3_0p6b': 596_049_920,  # Qwen3 model card 0.6B (tied head once)
  'qwen3_1p7b': 1_720_574_976,  # Qwen3 model card 1.7B (tied head once)
  'qwen3_8b': 8_190_735_360,  # Qwen3 model card 8.2B
  'llama3_8b': 8_030_261_248,  # Meta-Llama-3-8B safetensors total
  'llada_8b': 8_015_581_184,  # LLaDA-8B-Base safetensors 8.02B (LLaDA paper's table)
  'sdar_1p7b': 2_031_739_904,  # Qwen3-1.7B's dims untied (presets.py: unconfirmed tying)
  'sdar_4b': 4_411_424_256,  # SDAR-4B-Chat index total_size 8,822,848,512 B / 2
  'sdar_8b': 8_190_735_360,  # SDAR-8B-Chat index total_size 16,381,470,720 B / 2
  'llada_moe_7b_a1b': 7_356_880_896,  # LLaDA-MoE-7B-A1B: its tensors' sum (paper: 7B)
  'qwen3_30b_a3b': 30_532_122_624,  # Qwen3-30B-A3B model card 30.5B
  # LLaDA2.0 README: 16B and 100B; these exact sums (the router biases included) are the
  # config.json shapes' (no safetensors index total was read to confirm them).
  'llada2_mini': 16_255_643_392,
  'llada2_flash': 102_889_705_216,
}


def test_every_preset_prints_its_published_count_and_the_model_builds_it():
  """`summary --config.model.preset=NAME` (the command line's path, in process) prints the
  published count; 'tiny' and 'tiny_moe', ours, are checked against the parameters the model
  actually builds."""
  import re  # pylint: disable=import-outside-toplevel

  import jax  # pylint: disable=import-outside-toplevel

  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel
  from dlmjax import summary  # pylint: disable=import-outside-toplevel

  def built(name):
    tiny = config_lib.defaults()
    model_lib.apply_preset(tiny.model, name)
    shapes = model_lib.abstract(model_lib.ModelConfig.from_config(tiny))[1]
    return sum(x.size for x in jax.tree.leaves(shapes))

  published = dict(PUBLISHED, tiny=built('tiny'), tiny_moe=built('tiny_moe'))
  assert set(published) == set(model_lib.PRESETS), 'add the published count of a new preset'
  for name, count in published.items():
    argv = ['--config=configs/tiny.py', f'--config.model.preset={name}']
    config, _ = config_lib.parse_command_line(argv, 'configs/tiny.py', model_lib.PRESETS)
    printed = re.search(r'^parameters: ([\d,]+) ', summary.summarize(config, 1), re.M).group(1)
    assert int(printed.replace(',', '')) == count, name


def test_preset_on_the_command_line_sets_its_fields_and_later_overrides_win():
  result = _run('--config.model.preset=sdar_8b', '--config.model.seq_len=512', '--devices=1')
  assert result.returncode == 0, result.stderr
  assert 'parameters: 8,190,735,360 ' in result.stdout
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel

  config = config_lib.apply_overrides(
    config_lib.defaults(), ['model.preset=llada_8b', 'model.seq_len=512'], model_lib.PRESETS
  )
  assert (config.model.d_model, config.model.seq_len) == (4096, 512)
  with pytest.raises(config_lib.ConfigError, match="model.preset='llada_9b' is not a preset"):
    config_lib.apply_overrides(config, ['model.preset=llada_9b'], model_lib.PRESETS)
  with pytest.raises(config_lib.ConfigError, match='apply_preset'):  # no table: a file's key
    config_lib.apply_overrides(config, ['model.preset=llada_8b'])


def test_an_init_from_config_describes_the_model_it_trains(tmp_path):
  """configs/sft.py fine-tunes init_from's model: summary counts that model, not the default."""
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel
  from dlmjax import model as model_lib  # pylint: disable=import-outside-toplevel
  from dlmjax import summary  # pylint: disable=import-outside-toplevel

  source = config_lib.load_file('configs/tiny.py')
  config_lib.apply_overrides(source, {'model.num_layers': 3, 'model.ffn_dim': 320})
  (tmp_path / 'checkpoints' / '7' / 'params').mkdir(parents=True)
  (tmp_path / 'config.json').write_text(source.to_json())
  config = config_lib.load_file('configs/sft.py')
  config.init_from = str(tmp_path / 'checkpoints' / '7')
  text = summary.summarize(config, 1)
  count = model_lib.ModelConfig.from_config(source).num_params()
  assert f'parameters: {count:,} with' in text
  assert 'model.num_layers=3' in text and 'model.ffn_dim=320' in text
  missing = config_lib.load_file('configs/sft.py')
  missing.init_from = str(tmp_path / 'none')  # not trained yet: said, the config's model shown
  text = summary.summarize(missing, 1)
  assert text.startswith("model: the config's own keys, not init_from's (") and 'none' in text
