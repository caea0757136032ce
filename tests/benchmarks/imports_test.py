"""Every script in benchmarks/ and scripts/ imports only what dlmjax and benchmarks/ still hold.

The scripts live outside the package and most have no test that runs them, so a renamed module
would break them silently; this reads their imports without running them (several define absl
flags of the same names, so they cannot all be imported into one process).
"""

import ast
import importlib
import pathlib

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_SCRIPTS = sorted(
  p
  for p in [*(_ROOT / 'benchmarks').rglob('*.py'), *(_ROOT / 'scripts').rglob('*.py')]
  if p.name != '__init__.py'
)
_OURS = ('dlmjax', 'benchmarks')


def _imports(path):
  """(module, name or None) for each import of dlmjax or benchmarks in the file."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from ((a.name, None) for a in node.names if a.name.split('.')[0] in _OURS)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split('.')[0] in _OURS:
        yield from ((node.module, a.name) for a in node.names)


@pytest.mark.parametrize('path', _SCRIPTS, ids=lambda p: str(p.relative_to(_ROOT)))
def test_script_imports_resolve(path):
  for module, name in _imports(path):
    imported = importlib.import_module(module)
    if name is not None and not hasattr(imported, name):
      importlib.import_module(f'{module}.{name}')  # a submodule, else ModuleNotFoundError


def test_every_benchmark_is_found():
  names = {str(p.relative_to(_ROOT)) for p in _SCRIPTS}
  assert {
    'benchmarks/sampler.py',
    'benchmarks/rl_recipe_search.py',
    'scripts/research/rl_direction_check.py',
  } <= names
