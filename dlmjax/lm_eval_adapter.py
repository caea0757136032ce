"""lm-evaluation-harness model `dlmjax`: loglikelihood by LLaDA's MC ELBO, text by the sampler.

  python -m dlmjax.lm_eval_adapter --model dlmjax \\
      --model_args checkpoint_path=runs/x,mc_num=128,mc_batch=32,cfg=0.5 --tasks arc_easy,piqa
  python -m dlmjax.lm_eval_adapter --model dlmjax --model_args checkpoint_path=runs/x \\
      --local-tasks gsm8k=gsm8k_test.jsonl,math500=math500.jsonl,humaneval=humaneval.jsonl \\
      --tasks dlmjax_gsm8k,dlmjax_math500,dlmjax_humaneval

lm-eval finds models only in its own registry, so this module registers `dlmjax` and then runs
lm-eval's command line (every lm-eval flag works); in Python, `import dlmjax.lm_eval_adapter`
before `lm_eval.simple_evaluate(model='dlmjax', ...)`. Needs `pip install lm-eval` (the `eval`
extra). As LLaDA's eval_llada.py: is_greedy is always False (its greedy check costs T forward
passes per request and no reported metric uses it) and loglikelihood_rolling is not offered.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from dlmjax import extras

try:
  from lm_eval.api.model import LM
  from lm_eval.api.registry import register_model
except ImportError as e:
  _message = extras.missing_message(e, 'dlmjax.lm_eval_adapter')
  if _message is None:
    raise
  if __name__ == '__main__':  # the command line: one line, no traceback
    print(f'error: {_message}', file=sys.stderr)
    sys.exit(2)
  raise ImportError(_message, name=e.name) from e

from dlmjax import evaluate
from dlmjax import tasks
from dlmjax.data import records
from dlmjax.diffusion import likelihood as likelihood_lib
from dlmjax.diffusion import sampling_config


@register_model('dlmjax')
class DlmjaxLM(LM):
  """model_args: checkpoint_path (required), mc_num, mc_batch, cfg (likelihood and sampler),
  the sampler's settings by their SamplingConfig names (gen_length, steps, block_length,
  temperature, top_p, remasking, threshold, cache, cache_refresh, stop_at_eos, alg_temp, factor;
  defaults: LLaDA's demo), seed, tokenizer, dtype; batch_size from lm-eval."""

  def __init__(
    self,
    checkpoint_path: str,
    mc_num: int = 128,
    mc_batch: int = 32,
    cfg: float = 0.0,
    seed: int = 0,
    tokenizer: str = '',
    dtype: str | None = None,
    batch_size=8,
    **kwargs,
  ):
    super().__init__()
    # Other kwargs: lm-eval's device / max_batch_size, which a JAX model does not use.
    settings = likelihood_lib.LikelihoodConfig(
      mc_num=int(mc_num), mc_batch=int(mc_batch), cfg_scale=float(cfg)
    )
    sampling = sampling_config.SamplingConfig.from_values(
      cfg_scale=cfg, **{k: v for k, v in kwargs.items() if k in sampling_config.FIELDS}
    )
    rows = int(batch_size) if str(batch_size).isdigit() else 8  # 'auto' -> 8
    self.model = evaluate.EvalModel(
      checkpoint_path,
      settings=settings,
      sampling=sampling,
      tokenizer=tokenizer,
      seed=int(seed),
      batch_size=rows,
      dtype=dtype,
    )

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    scores = self.model.loglikelihood([tuple(r.args[:2]) for r in requests])
    return [(float(s), False) for s in scores]

  def loglikelihood_rolling(self, requests):
    raise NotImplementedError(
      'dlmjax scores (context, continuation) pairs; rolling perplexity '
      'has no diffusion counterpart here (as in LLaDA).'
    )

  def generate_until(self, requests) -> list[str]:
    """The sampler's completion of each context, cut at the first stop string (`until`); the
    length is model_args gen_length (max_gen_toks is not read: the canvas is fixed)."""
    texts = self.model.generate([r.args[0] for r in requests], template=False)
    out = []
    for request, text in zip(requests, texts):
      for stop in request.args[1].get('until') or []:
        if stop and stop in text:
          text = text.split(stop)[0]
      out.append(text)
    return out


# Local-file tasks: lm-eval tasks named dlmjax_NAME whose prompts and metrics are dlmjax.tasks'
# own (the same extraction as `python -m dlmjax.evaluate tasks`; docs/evaluation.md).
_TASK_YAML = """task: dlmjax_{name}
dataset_path: {builder}
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: !function dlmjax_local_tasks.doc_to_text_{name}
doc_to_target: !function dlmjax_local_tasks.doc_to_target
process_results: !function dlmjax_local_tasks.process_results_{name}
generation_kwargs:
  until: []
metric_list:
{metrics}
"""
_UTILS_HEADER = """from dlmjax import lm_eval_adapter as _adapter


def doc_to_target(doc):
  return ''
"""
_UTILS_TASK = """

def doc_to_text_{name}(doc):
  return _adapter.local_example({name!r}, doc).prompt


def process_results_{name}(doc, results):
  return _adapter.local_metrics({name!r}, doc, results)
"""
_BUILDERS = {'.jsonl': 'json', '.json': 'json', '.parquet': 'parquet', '.csv': 'csv'}
_COLUMNS = {}  # task name -> the data.columns spec its rows are renamed by


def local_example(name: str, doc: dict):
  task = tasks.FILE_TASKS[name]('')
  return task.example_of(records.rename(dict(doc), records.parse_columns(_COLUMNS.get(name, ''))))


def local_metrics(name: str, doc: dict, results: list[str]) -> dict[str, float]:
  metrics = tasks.FILE_TASKS[name]('').metrics([local_example(name, doc)], [results[0]])
  return {key: values[0] for key, values in metrics.items()}


def write_local_tasks(entries: list[tuple[str, str]], directory: str, columns: str = '') -> list:
  """lm-eval task files (dlmjax_NAME) for (name, test file) entries; returns the task names."""
  utils, names = [_UTILS_HEADER], []
  for name, path in entries:
    if name not in tasks.FILE_TASKS:
      raise ValueError(
        f'--local-tasks {name}: not a file task; choose from {sorted(tasks.FILE_TASKS)}.'
      )
    if getattr(tasks.FILE_TASKS[name], 'infill', False):
      raise ValueError(
        f'--local-tasks {name}: lm-eval generates after a prompt and cannot fill a hole; run '
        f'python -m dlmjax.evaluate ... tasks --tasks {name}={path}.'
      )
    builder = _BUILDERS.get(os.path.splitext(path)[1])
    if builder is None or not os.path.isfile(path):
      raise ValueError(f'--local-tasks {name}={path}: needs an existing {sorted(_BUILDERS)} file.')
    _COLUMNS[name] = columns
    example = tasks.get_task(name, data_path=f',{path}', columns=columns).examples('test', 1, 0)
    keys = tasks.FILE_TASKS[name]('').metrics(example, [''])
    metrics = '\n'.join(
      f'  - metric: {key}\n    aggregation: mean\n    higher_is_better: true' for key in keys
    )
    yaml = _TASK_YAML.format(
      name=name, builder=builder, path=os.path.abspath(path), metrics=metrics
    )
    with open(os.path.join(directory, f'dlmjax_{name}.yaml'), 'w') as f:
      f.write(yaml)
    utils.append(_UTILS_TASK.format(name=name))
    names.append(f'dlmjax_{name}')
  with open(os.path.join(directory, 'dlmjax_local_tasks.py'), 'w') as f:
    f.write(''.join(utils))
  return names


def main(argv=None) -> None:
  """lm-eval's command line with `dlmjax` registered; --local-tasks NAME=FILE,... (and
  --local-columns SPEC) adds dlmjax_NAME tasks read from local test files."""
  from lm_eval.__main__ import cli_evaluate  # pylint: disable=import-outside-toplevel

  argv = sys.argv[1:] if argv is None else list(argv)
  local = argparse.ArgumentParser(add_help=False)
  local.add_argument('--local-tasks', default='')
  local.add_argument('--local-columns', default='')
  known, rest = local.parse_known_args(argv)
  if known.local_tasks:
    directory = tempfile.mkdtemp(prefix='dlmjax-lm-eval-')
    try:
      write_local_tasks(evaluate.parse_task_list(known.local_tasks), directory, known.local_columns)
    except ValueError as e:
      print(f'error: {e}', file=sys.stderr)
      sys.exit(2)
    rest += ['--include_path', directory]
  sys.argv = [sys.argv[0], *rest]
  cli_evaluate()


if __name__ == '__main__':
  sys.exit(main())
