"""Optional dependencies: which extra of pyproject.toml installs each, and the one line that says
so when a command needs one that is missing (instead of an ImportError traceback)."""

from __future__ import annotations

import functools
import sys

# Top-level module -> the extra that installs it (pyproject.toml [project.optional-dependencies]).
EXTRAS = {
  'torch': 'torch',
  'transformers': 'torch',
  'safetensors': 'torch',
  'lm_eval': 'eval',
  'matplotlib': 'plot',
  'tensorflow': 'tfds',
  'tensorflow_datasets': 'tfds',
}


def missing_message(error: ImportError, what: str) -> str | None:
  """'WHAT needs NAME, which is not installed: pip install "dlmjax[EXTRA]"', or None when the
  missing module is no optional dependency (then it is a real bug and should propagate)."""
  name = (getattr(error, 'name', None) or '').split('.')[0]
  if name not in EXTRAS:
    return None
  return f'{what} needs {name}, which is not installed: pip install "dlmjax[{EXTRAS[name]}]"'


def name_missing_extras(what: str):
  """Decorates a command's main(argv) -> exit code: a missing optional dependency prints one
  `error:` line naming the extra and returns 2."""

  def decorate(main):
    @functools.wraps(main)
    def run(*args, **kwargs):
      try:
        return main(*args, **kwargs)
      except ImportError as e:
        message = missing_message(e, what)
        if message is None:
          raise
        print(f'error: {message}', file=sys.stderr)
        return 2

    return run

  return decorate
