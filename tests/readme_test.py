"""Every command in README.md works as written: the modules, scripts, config files and config keys
it names exist, each flag is one its command accepts (read from the command's --help), and the
cheap commands run (summary). Paths the prose names exist too."""

import contextlib
import functools
import importlib
import io
import os
import re
import shlex

import pytest

from dlmjax import config as config_lib
from dlmjax.model import presets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, 'README.md')).read()
# Commands whose positional first argument picks a sub-parser with its own flags.
SUBCOMMANDS = {
  'dlmjax.convert': ('to-hf', 'from-hf', 'to-torch', 'from-torch'),
  'dlmjax.evaluate': ('likelihood', 'tasks'),
  'dlmjax.preprocess': ('train-tokenizer',),
}
ABSL = ('dlmjax.train', 'dlmjax.summary', 'dlmjax.bench')  # flags: --config.* and absl DEFINEs
OTHER_FLAGS = ('dlmjax.lm_eval_adapter',)  # lm-eval's own command line


def _commands():
  """Each shell command of the README's bash blocks, as a token list (comments, continuation
  lines, `;` and `&&` handled; [optional] brackets dropped)."""
  out = []
  for block in re.findall(r'```bash\n(.*?)```', README, re.S):
    for line in block.replace('\\\n', ' ').split('\n'):
      tokens = shlex.split(line, comments=True)
      command = []
      for token in tokens + [';']:
        if token in (';', '&&'):
          if command:
            out.append(command)
          command = []
        elif token.startswith('[') or token.endswith(']'):  # [optional] flags: their words
          command.extend(t for t in token.strip('[]').split() if t)
        else:  # a quoted argument stays one
          command.append(token)
  return out


COMMANDS = _commands()


def _python_module(command):
  """(module, args) of a `[VAR=...] python -m MODULE ARGS` command, else None."""
  while command and re.match(r'^[A-Z_]+=', command[0]):
    command = command[1:]
  if len(command) > 2 and command[0].endswith(('python', 'python3')) and command[1] == '-m':
    return command[2], command[3:]
  return None


def _help(module_name: str, args) -> str:
  """The --help text of a command (and of its sub-command), captured in-process."""
  module = importlib.import_module(module_name)
  if not hasattr(module, 'main'):  # a package run by its __main__ (python -m dlmjax.serve)
    module = importlib.import_module(module_name + '.__main__')
  texts = []
  subs = [a for a in args if a in SUBCOMMANDS.get(module_name, ())][:1]
  for argv in [['--help']] + [[sub, '--help'] for sub in subs]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit):
      module.main(argv)
    texts.append(buffer.getvalue())
  return '\n'.join(texts)


@functools.cache
def _absl_flags(module_name: str) -> frozenset:
  from absl import flags  # pylint: disable=import-outside-toplevel

  importlib.import_module(module_name)
  return frozenset(flags.FLAGS)


def test_the_readme_has_commands():
  modules = {m[0] for m in map(_python_module, COMMANDS) if m}
  assert {'dlmjax.train', 'dlmjax.convert', 'dlmjax.summary', 'dlmjax.generate'} <= modules


@pytest.mark.parametrize('command', COMMANDS, ids=lambda c: ' '.join(c)[:60])
def test_each_command_names_what_exists(command):
  parsed = _python_module(command)
  if parsed is None:
    words = [w for w in command if not re.match(r'^[A-Z_]+=', w)]
    if words[0] in ('bash', 'sbatch', 'cp'):
      assert os.path.isfile(os.path.join(ROOT, words[1])), words[1]
    return
  module, args = parsed
  if module.startswith('benchmarks.'):
    assert os.path.isfile(os.path.join(ROOT, *module.split('.')) + '.py'), module
    return
  assert importlib.util.find_spec(module) is not None, module
  config_file = next((a.split('=', 1)[1] for a in args if a.startswith('--config=')), None)
  config = config_lib.load_file(config_file or 'configs/tiny.py')  # the file and its ARG load
  overrides = [a for a in args if a.startswith('--config.')]
  config_lib.apply_overrides(config, overrides, presets.PRESETS)  # every key exists and parses
  flags = {a.split('=', 1)[0] for a in args if a.startswith('--') and not a.startswith('--config')}
  if module in OTHER_FLAGS or not flags:
    return
  if module in ABSL:
    known = {f'--{name}' for name in _absl_flags(module)}
  else:
    known = set(re.findall(r'--[a-z][a-z0-9-]*', _help(module, args)))
  assert flags <= known, f'{module}: {sorted(flags - known)} not among its flags'


def test_summary_examples_run():
  """summary is the README's cheap command: each of its examples runs to the memory verdict."""
  from dlmjax import summary  # pylint: disable=import-outside-toplevel

  examples = [a for m, a in filter(None, map(_python_module, COMMANDS)) if m == 'dlmjax.summary']
  assert examples
  for args in examples:
    config, rest = config_lib.parse_command_line(args, 'configs/tiny.py', presets.PRESETS)
    values = dict(a[2:].split('=', 1) for a in rest if '=' in a)
    devices = int(values.get('devices', 0)) or None
    summary.summarize(config, devices)
    summary.check_memory(config, 0.0, values.get('device-kind', ''))  # the GPU it names, if any


def test_paths_the_readme_names_exist():
  named = re.findall(
    r'(?<![\w/.])((?:configs|scripts|docs|benchmarks|dlmjax|envs)/[\w./-]*\w)', README
  )
  placeholders = {'configs/z.py', 'envs/.env'}  # the user's config; the copy `cp` makes
  missing = [p for p in set(named) - placeholders if not os.path.exists(os.path.join(ROOT, p))]
  assert not missing, missing


def _train_configs():
  """(command, config) of each README train command, overrides applied and validated."""
  out = []
  for module, args in filter(None, map(_python_module, COMMANDS)):
    if module != 'dlmjax.train':
      continue
    config, _ = config_lib.parse_command_line(args, 'configs/tiny.py', presets.PRESETS)
    config_lib.validate(config)  # every value a run checks before it starts
    out.append((' '.join(args), config))
  return out


def test_train_commands_validate_and_never_share_a_run_directory():
  """Two README train commands of different configs writing one output_dir would make the second
  refuse to resume, or (a finished run) do nothing: each gets its own directory."""
  by_dir = {}
  for command, config in _train_configs():
    config_json = config.to_json(sort_keys=True)
    by_dir.setdefault(config.output_dir, {})[config_json] = command
  shared = {d: sorted(c.values()) for d, c in by_dir.items() if len(c) > 1}
  assert not shared, shared


QUICK_START_RUNS = ('runs/tiny', 'runs/sft', 'runs/sft_lora')  # configs/tiny.py's model
SAMPLER_COMMANDS = {
  'dlmjax.generate': 'dlmjax.generate',
  'dlmjax.evaluate': 'dlmjax.evaluate',
  'dlmjax.serve': 'dlmjax.serve.__main__',
}


def test_sampling_commands_fit_the_quick_start_model():
  """generate / evaluate / serve on a quick-start run: the flags parse with the command's own
  parser, the sampler settings validate, and a short prompt plus gen_length fits its context."""
  from dlmjax.diffusion import sampling_config  # pylint: disable=import-outside-toplevel

  seq_len = config_lib.load_file('configs/tiny.py').model.seq_len
  checked = 0
  for module, args in filter(None, map(_python_module, COMMANDS)):
    if module not in SAMPLER_COMMANDS or '--checkpoint-path' not in args:
      continue
    if args[args.index('--checkpoint-path') + 1] not in QUICK_START_RUNS:
      continue
    parsed = importlib.import_module(SAMPLER_COMMANDS[module])._parser().parse_args(args)
    if getattr(parsed, 'mode', 'tasks') == 'likelihood':
      continue
    settings = sampling_config.from_arguments(parsed)
    prompt = 16  # a short prompt's tokens
    assert prompt + settings.gen_length <= seq_len, (
      f'{module} {" ".join(args)}: gen_length {settings.gen_length} leaves no room for a prompt '
      f'in the quick-start model context of {seq_len}; set --gen-length'
    )
    checked += 1
  assert checked >= 3


def test_cpu_machines_are_told_to_install_the_cpu_torch_first():
  """PyPI's Linux torch is the CUDA build: the README gives the CPU index before the extra."""
  cpu = README.index('pip install torch --index-url https://download.pytorch.org/whl/cpu')
  assert cpu < README.index('pip install -e ".[torch]"')


def test_lora_recipe_has_its_own_directory_and_an_adapter_rate():
  full, lora = config_lib.load_file('configs/sft.py'), config_lib.load_file('configs/sft.py:lora')
  assert lora.train.lora.rank > 0 and full.train.lora.rank == 0
  assert lora.output_dir != full.output_dir and lora.train.lr >= 10 * full.train.lr
  assert 'configs/sft.py:lora' in README
