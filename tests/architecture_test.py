"""The import graph of dlmjax: layers, each importing only its own and lower ones, and no circle.

From the bottom up (LAYERS below is the table, by package: a module takes its package's layer):

  base        config (the schema, read by everything; each feature registers its checks into
              it), observability (logging sinks, progress bars)
  parallel    mesh axes and sharding rules, the distributed runtime; kernels beside them
  model       the transformer and its programs
  data        readers, tokenizers, chat templates, the grain pipeline
  tasks       problem sets and rewards (they read data files)
  diffusion   the masking process, losses, likelihood and sampler (the SFT loss reads data.roles)
  checkpoint  orbax run checkpoints, Hugging Face / PyTorch I/O (hf_io), init_from
  rl/inference  rl (rollouts, estimators, objectives) and inference (load_pretrained)
  train       the state, step, loop, stages, the SFT rows (train.sft_rows: its built-in
              instruction set is made from the tasks' problems) and what the loop reports
  cli         the package root: the command lines (generate, evaluate, convert, verify, ...,
              and every package's __main__, train's), extras (their optional dependencies)

Every import counts, top-level and inside functions. An import inside a function is only for a
heavy optional dependency (a dlmjax module that imports torch, tensorflow, lm_eval, ... at its
top), and the package root's lazy `dlmjax.load_pretrained`.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'dlmjax'

# Each package's layer; a package not listed takes its parent's. A package's __main__ is its
# command line (the cli layer), whatever the package.
LAYERS = (
  ('base', ('dlmjax.config', 'dlmjax.observability')),
  ('parallel', ('dlmjax.parallel', 'dlmjax.kernels')),
  ('model', ('dlmjax.model',)),
  ('data', ('dlmjax.data',)),
  ('tasks', ('dlmjax.tasks',)),
  ('diffusion', ('dlmjax.diffusion',)),
  ('checkpoint', ('dlmjax.checkpoint',)),
  ('rl/inference', ('dlmjax.rl', 'dlmjax.inference')),
  ('train', ('dlmjax.train',)),
  ('cli', ('dlmjax',)),
)
# Third-party packages that are optional extras (pyproject.toml): a module importing one of these
# at its top may be imported inside a function, so that the rest runs without the extra.
OPTIONAL = (
  'torch',
  'transformers',
  'safetensors',
  'tensorflow',
  'tensorflow_datasets',
  'lm_eval',
  'tensorboard',
  'fastapi',  # the serve extra (python -m dlmjax.serve)
  'uvicorn',
)
LAZY = {('dlmjax', 'dlmjax.inference')}  # the package root's attribute (PEP 562 __getattr__)


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix('').parts)
  if parts[-1] == '__init__':
    parts.pop()
  return '.'.join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(p): p for p in sorted(PACKAGE.rglob('*.py'))}


def _packages() -> set[str]:
  return {_module_name(p) for p in PACKAGE.rglob('__init__.py')}


_PACKAGE_LAYER = {
  package: index for index, (_, packages) in enumerate(LAYERS) for package in packages
}
_CLI = len(LAYERS) - 1


def _layer(module: str) -> int:
  """The layer of the module's package (a listed package, or the nearest listed ancestor)."""
  if module.rpartition('.')[2] == '__main__':
    return _CLI
  package = module if module in _packages() else module.rpartition('.')[0]
  while package not in _PACKAGE_LAYER:
    assert '.' in package, f'{module} is in no layer of LAYERS'
    package = package.rpartition('.')[0]
  return _PACKAGE_LAYER[package]


def _import_statements(node, inner: bool):
  """(import statement, inside a function) below node; imports are statements, so only
  statements (and except handlers) are entered."""
  for child in ast.iter_child_nodes(node):
    if isinstance(child, (ast.Import, ast.ImportFrom)):
      yield child, inner
    elif isinstance(child, (ast.stmt, ast.excepthandler)):
      yield from _import_statements(
        child, inner or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
      )


def _imports(module: str, path: pathlib.Path, modules):
  """(dlmjax module or None, line, inside a function, top package) of each name imported."""
  package = module if path.name == '__init__.py' else module.rpartition('.')[0]
  for node, inner in _import_statements(ast.parse(path.read_text(), str(path)), False):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # relative: from this package, up level - 1 packages
        parts = package.split('.')
        base = '.'.join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
      # `from a.b import c` imports the module a.b.c, or the attribute c of a.b.
      names = [f'{base}.{a.name}' if f'{base}.{a.name}' in modules else base for a in node.names]
    for name in names:
      top = name.split('.')[0]
      if top == 'dlmjax':
        while name not in modules:  # `import dlmjax.a.b` of a module; never of an attribute
          name = name.rpartition('.')[0]
        if name == module:
          continue
      yield (name if top == 'dlmjax' else None), node.lineno, inner, top


@functools.lru_cache(maxsize=1)  # parsed once for all the tests here (~0.2 s)
def import_graph():
  """{module: [(target, file:line, inside a function)]} over dlmjax's own modules, and the
  modules that import an optional extra at their top."""
  modules = _modules()
  graph, heavy = {}, set()
  for module, path in modules.items():
    edges = {}
    for target, line, inner, third_party in _imports(module, path, modules):
      if target is None:
        if third_party in OPTIONAL and not inner:
          heavy.add(module)
        continue
      where = f'{path.relative_to(ROOT)}:{line}'
      if (target, inner) not in edges:
        edges[target, inner] = where
    graph[module] = [(target, where, inner) for (target, inner), where in edges.items()]
  return graph, heavy


def _name(index: int) -> str:
  return f'{LAYERS[index][0]} ({index})'


def test_every_package_maps_to_exactly_one_layer():
  """LAYERS names packages, each once: a module's layer is its package's, never its own name's."""
  listed = [package for _, packages in LAYERS for package in packages]
  assert len(listed) == len(set(listed)), 'a package is listed in two layers'
  assert set(listed) <= _packages(), f'not packages: {sorted(set(listed) - _packages())}'
  for module in _modules():
    _layer(module)


def test_no_module_imports_a_higher_layer():
  graph, _ = import_graph()
  upward = [
    f'{where}: {module} [{_name(_layer(module))}] imports {target} '
    f'[{_name(_layer(target))}]{" inside a function" if inner else ""}'
    for module, edges in sorted(graph.items())
    for target, where, inner in edges
    if _layer(target) > _layer(module)
  ]
  assert not upward, (
    'imports that go up a layer (tests/architecture_test.py, LAYERS):\n  ' + '\n  '.join(upward)
  )


def test_imports_inside_functions_only_defer_optional_extras():
  graph, heavy = import_graph()
  deferred = [
    f'{where}: {module} imports {target} inside a function (import it at the top; '
    'only modules that need an optional extra are imported late)'
    for module, edges in sorted(graph.items())
    for target, where, inner in edges
    if inner and target not in heavy and (module, target) not in LAZY
  ]
  assert not deferred, '\n'.join(deferred)


def test_no_import_circle():
  graph, _ = import_graph()
  edges = {m: sorted({t for t, _, _ in e}) for m, e in graph.items()}
  where = {(m, t): w for m, e in graph.items() for t, w, _ in e}
  state, circles = {}, []

  def visit(module, stack):  # depth-first; a grey (on the stack) target closes a circle
    state[module] = 'grey'
    stack.append(module)
    for target in edges.get(module, ()):
      if state.get(target) == 'grey':
        circle = stack[stack.index(target) :] + [target]
        circles.append(
          ' -> '.join(circle)
          + '  ('
          + ', '.join(where[a, b] for a, b in zip(circle, circle[1:]))
          + ')'
        )
      elif target not in state:
        visit(target, stack)
    stack.pop()
    state[module] = 'black'

  for module in sorted(edges):
    if module not in state:
      visit(module, [])
  assert not circles, 'import circles:\n  ' + '\n  '.join(circles)


# Users of the package: they import only its public API (no `_name`, no `_module`). Research
# probes (scripts/research/) may patch internals to test a hypothesis; they are not users.
USERS = ('benchmarks', 'scripts', 'configs')
RESEARCH = ROOT / 'scripts' / 'research'


def _private_uses(path: pathlib.Path, package: str = 'dlmjax'):
  """(line, what) of each private name of `package` that a file imports or reads."""
  tree = ast.parse(path.read_text(), str(path))
  aliases = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or '').split('.')[0] == package:
      for a in node.names:
        if any(part.startswith('_') for part in [*node.module.split('.'), a.name]):
          yield node.lineno, f'from {node.module} import {a.name}'
        aliases.add(a.asname or a.name)
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split('.')[0] == package:
          if any(part.startswith('_') for part in a.name.split('.')):
            yield node.lineno, f'import {a.name}'
          aliases.add((a.asname or a.name).split('.')[0])
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr.startswith('_'):
      if node.attr.startswith('__') and node.attr.endswith('__'):
        continue
      base = node.value
      while isinstance(base, ast.Attribute):
        base = base.value
      if isinstance(base, ast.Name) and base.id in aliases:
        yield node.lineno, ast.unparse(node)


def test_benchmarks_scripts_and_configs_use_only_the_public_api():
  private = [
    f'{path.relative_to(ROOT)}:{line}: {what}'
    for folder in USERS
    for path in sorted((ROOT / folder).rglob('*.py'))
    if RESEARCH not in path.parents
    for line, what in _private_uses(path)
  ]
  assert not private, 'private names of dlmjax used outside it:\n  ' + '\n  '.join(private)


def test_test_files_share_helpers_only_by_public_names():
  """A helper two test files need lives in a helper module (conftest, tests/**/<helper>.py)
  under a public name, not as one test file's private function."""
  private = [
    f'{path.relative_to(ROOT)}:{line}: {what}'
    for path in sorted((ROOT / 'tests').rglob('*.py'))
    for line, what in _private_uses(path, 'tests')
  ]
  assert not private, 'private names of another test file:\n  ' + '\n  '.join(private)


if __name__ == '__main__':  # prints the edges between layers (what the tests check)
  g, _ = import_graph()
  for m, es in sorted(g.items()):
    for t, w, inner in es:
      if _layer(t) != _layer(m):
        print(
          f'{_name(_layer(m)):>16} {m} -> {t} [{_name(_layer(t))}] {w}'
          f'{" (function)" if inner else ""}'
        )


def test_lazy_registry_references_stay_in_their_registrys_package():
  """A registry that names its members by 'module:ATTR' (config/lazy.py) imports them at run time,
  out of the import graph's sight above: each reference must name a module inside the registry's
  own package (so its layer is the registry's) that exists and defines ATTR."""
  import importlib  # pylint: disable=import-outside-toplevel

  graph, _ = import_graph()
  registries = [
    m for m, edges in graph.items() if any(t == 'dlmjax.config.lazy' for t, *_ in edges)
  ]
  assert registries, 'no registry imports dlmjax.config.lazy any more: drop this test'
  for registry in registries:
    module_ = importlib.import_module(registry)
    tables = [
      t
      for t in vars(module_).values()
      if isinstance(t, dict) and t and all(isinstance(v, str) and ':' in v for v in t.values())
    ]
    assert tables, f'{registry} imports config.lazy but holds no table of references'
    for name, reference in (item for table in tables for item in table.items()):
      module, _, attribute = reference.partition(':')
      assert module.startswith(registry + '.'), f'{registry}[{name!r}] = {reference!r}'
      assert hasattr(importlib.import_module(module), attribute), f'{reference!r} is missing'
