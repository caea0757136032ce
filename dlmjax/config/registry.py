"""The validation registry: each feature checks its own keys in a `config_checks` module beside
its code and registers the checks and choice lists here; `validate` runs them all.

The schema sits at the bottom of the import graph, below the features it is checked by, so it
cannot import them: it names their check modules (CHECK_MODULES, in the order their errors are
reported) and imports them by name the first time a config is validated. Each module registers
on import; tests/config_test.py checks that the list holds every `config_checks` module. A check
module imports no jax (nor flax, optax, orbax, grain): it reads the choice lists from its
package's jax-free `choices` module or a registry of references (config/lazy.py), so that
`validate_early` refuses a bad config in a fraction of a second (tests/cli_test.py checks it).
"""

from __future__ import annotations

import importlib

import ml_collections

from dlmjax.config.derived import MESH_AXES, fit_schedule, resolve_mesh
from dlmjax.config.errors import ConfigError
from dlmjax.config.keys import get_key

CHECK_MODULES = (
  'dlmjax.data.config_checks',  # data.*, sft.*
  'dlmjax.model.config_checks',  # model.* (MoE on the resolved mesh), train.lora.*
  'dlmjax.train.config_checks',  # stage, train.*, checkpoint.*, log.*, eval.*
  'dlmjax.rl.config_checks',  # rl.*
  'dlmjax.diffusion.config_checks',  # diffusion.*, sampler.*
  'dlmjax.diffusion.distill.config_checks',  # sft.objective and the distillation keys
  'dlmjax.parallel.config_checks',  # mesh.*
)
# When a check runs: 'values' on the config as given; 'mesh_axes' and then 'mesh' on a copy
# whose -1 mesh axis is resolved (for num_devices, or counted as 1 without it): 'mesh_axes'
# checks the axes themselves, 'mesh' what must divide them.
PHASES = ('values', 'mesh_axes', 'mesh')

_CHOICES: dict[str, tuple[str, ...]] = {}
_CHECKS: dict[str, list] = {phase: [] for phase in PHASES}


def choices(key: str, names) -> None:
  """Registers the values `key` may take, read from the feature that owns them (its table)."""
  if key in _CHOICES:
    raise ValueError(f'the choices of {key} are registered twice')
  _CHOICES[key] = tuple(names)


def check(fn=None, *, phase: str = 'values', stage: str | None = None):
  """Registers fn(config) as a check (a decorator; phase 'mesh': fn(config, num_devices)); it
  raises ConfigError naming the key and the fix. With `stage`, it checks only that stage's
  configs (a group only one stage reads)."""
  if phase not in PHASES:
    raise ValueError(f'phase {phase!r} is not one of {PHASES}')

  def register(f):
    _CHECKS[phase].append((f, stage))
    return f

  return register(fn) if fn is not None else register


def load() -> None:
  """Imports every check module, which registers its checks, choices and stages."""
  for name in CHECK_MODULES:
    importlib.import_module(name)  # registers on first import; later calls find it loaded


def registered_choices() -> dict[str, tuple[str, ...]]:
  """{key: its allowed values} of every feature (for the checks, the docs and the tests)."""
  load()
  return dict(_CHOICES)


def validate(config, num_devices: int | None = None) -> None:
  """Raises ConfigError naming the key and the fix for a config that cannot work.

  With num_devices, a -1 mesh axis is checked as resolved for that many devices.
  """
  _check_choices(config)
  for f, stage in _CHECKS['values']:
    if stage in (None, config.stage):
      f(config)
  # Check a resolved copy: with a device count a -1 axis takes its size, without one it counts 1.
  resolved = ml_collections.ConfigDict(config.to_dict())
  if num_devices is None:
    for axis in MESH_AXES:
      resolved.mesh[axis] = max(resolved.mesh[axis], 1)
  else:
    resolve_mesh(resolved, num_devices)
  for phase in PHASES[1:]:
    for f, stage in _CHECKS[phase]:
      if stage not in (None, config.stage):
        continue
      if phase == 'mesh':  # what must divide the mesh also needs the device count
        f(resolved, num_devices)
      else:
        f(resolved)


def validate_early(config, adopt_source) -> None:
  """What a command line refuses before it imports jax and builds anything (its first step):
  validate, on a copy whose schedule is fitted to train.steps as the run fits it and, when
  init_from is set, whose model keys are adopted from the source by `adopt_source`
  (checkpoint/init_from.py's adopt_source_config, the run's own: it reads the source's files
  without jax; this layer cannot import it). The choice lists are checked before the source is
  read, since a value outside them stays wrong whatever is adopted.

  Only what needs the device count waits for the run (the mesh's product against the devices
  present, fit_to_devices)."""
  config = ml_collections.ConfigDict(config.to_dict())
  fit_schedule(config)
  if config.init_from:
    _check_choices(config)
    adopt_source(config)
  validate(config)


def _check_choices(config) -> None:
  load()
  for key, names in _CHOICES.items():
    value = get_key(config, key)
    if value not in names:
      raise ConfigError(f'{key}={value!r} is not one of {names}; set --config.{key}=<one of them>.')


def fit_to_devices(config, num_devices: int) -> None:
  """Validates the config for num_devices, then resolves a -1 mesh axis in place."""
  validate(config, num_devices=num_devices)
  resolve_mesh(config, num_devices)
