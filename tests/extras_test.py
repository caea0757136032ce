"""A command that needs an optional dependency which is missing says which extra installs it, in
one line, instead of an ImportError traceback (the import is blocked through sys.modules)."""

import runpy
import sys

import pytest

from dlmjax import convert, extras, plot, verify


def _block(monkeypatch, name):
  """Makes `import name` (and its submodules) fail as if it were not installed."""
  for key in [k for k in sys.modules if k == name or k.startswith(name + '.')] + [name]:
    monkeypatch.setitem(sys.modules, key, None)


def _one_error_line(capsys):
  err = capsys.readouterr().err.strip()
  assert '\n' not in err and 'Traceback' not in err, err
  return err


def test_convert_names_the_torch_extra(tmp_path, monkeypatch, capsys):
  _block(monkeypatch, 'torch')
  args = ['to-torch', '--checkpoint-path', str(tmp_path), '--output', str(tmp_path / 'x.pt')]
  assert convert.main(args) == 2
  assert _one_error_line(capsys) == (
    'error: python -m dlmjax.convert needs torch, which is not installed: '
    'pip install "dlmjax[torch]"'
  )


def test_verify_names_the_torch_extra(monkeypatch, capsys):
  _block(monkeypatch, 'transformers')

  def verify_with_transformers(*args, **kwargs):
    import transformers  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

  monkeypatch.setattr(verify, 'verify', verify_with_transformers)
  assert verify.main(['--checkpoint-path', 'unused']) == 2
  assert _one_error_line(capsys).endswith(
    'needs transformers, which is not installed: pip install "dlmjax[torch]"'
  )


def test_plot_names_the_plot_extra(tmp_path, monkeypatch, capsys):
  _block(monkeypatch, 'matplotlib')
  assert plot.main([str(tmp_path)]) == 2
  assert 'pip install "dlmjax[plot]"' in _one_error_line(capsys)


def test_lm_eval_adapter_names_the_eval_extra(monkeypatch, capsys):
  _block(monkeypatch, 'lm_eval')
  with pytest.raises(SystemExit) as exit_info:
    runpy.run_module('dlmjax.lm_eval_adapter', run_name='__main__')
  assert exit_info.value.code == 2
  assert _one_error_line(capsys).endswith('pip install "dlmjax[eval]"')
  monkeypatch.delitem(sys.modules, 'dlmjax.lm_eval_adapter', raising=False)
  with pytest.raises(ImportError, match=r'dlmjax\[eval\]'):  # imported from Python: the same words
    __import__('dlmjax.lm_eval_adapter')


def test_other_missing_modules_are_not_blamed_on_an_extra():
  assert extras.missing_message(ModuleNotFoundError('x', name='numpy'), 'cmd') is None
