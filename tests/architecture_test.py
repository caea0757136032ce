"""The import graph of dlmjax: layers, each importing only its own and lower ones, and no circle.

From the bottom up (LAYERS below is the table; a module takes the layer of its longest prefix):

  base        config (the schema, read by everything; each feature registers its checks into
              it), extras (optional dependencies), progress, observability
  parallel    mesh axes and sharding rules, the distributed runtime; kernels beside them
  model       the transformer and its programs
  data        readers, tokenizers, chat templates, the grain pipeline
  tasks       problem sets and rewards (they read data files)
  diffusion   the masking process, losses, likelihood and sampler (the SFT loss reads data.roles)
  checkpoint  orbax run checkpoints, Hugging Face / PyTorch I/O (hf_io), init_from
  rl/inference  rl (rollouts, estimators, objectives) and inference (load_pretrained)
  train       the state, step, loop, stages, the SFT rows (train.sft_rows: its built-in
              instruction set is made from the tasks' problems) and what the loop reports
  cli         the command lines (train/__main__, generate, evaluate, convert, verify, ...) and
              the package root

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

LAYERS = (
  (
    'base',
    (
      'dlmjax.config',
      'dlmjax.extras',
      'dlmjax.progress',
      'dlmjax.observability',
    ),
  ),
  ('parallel', ('dlmjax.parallel', 'dlmjax.kernels')),
  ('model', ('dlmjax.model',)),
  ('data', ('dlmjax.data',)),
  ('tasks', ('dlmjax.tasks',)),
  ('diffusion', ('dlmjax.diffusion',)),
  ('checkpoint', ('dlmjax.checkpoint',)),
  ('rl/inference', ('dlmjax.rl', 'dlmjax.inference')),
  ('train', ('dlmjax.train',)),
  ('cli', ('dlmjax', 'dlmjax.train.__main__')),
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


def _layer(module: str) -> int:
  best, layer = -1, None
  for index, (_, prefixes) in enumerate(LAYERS):
    for prefix in prefixes:
      if (module == prefix or module.startswith(prefix + '.')) and len(prefix) > best:
        best, layer = len(prefix), index
  assert layer is not None, f'{module} is in no layer of LAYERS'
  return layer


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


def test_every_module_has_a_layer():
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


if __name__ == '__main__':  # prints the edges between layers (what the tests check)
  g, _ = import_graph()
  for m, es in sorted(g.items()):
    for t, w, inner in es:
      if _layer(t) != _layer(m):
        print(
          f'{_name(_layer(m)):>16} {m} -> {t} [{_name(_layer(t))}] {w}'
          f'{" (function)" if inner else ""}'
        )
