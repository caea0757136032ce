"""The lm-eval adapter on a tiny model and two local tasks (multiple choice, generation)."""

import json
import os

import pytest

lm_eval = pytest.importorskip('lm_eval')  # the `eval` extra

from dlmjax import lm_eval_adapter  # noqa: E402
from tests import evaluate_test  # noqa: E402

MC_YAML = """task: dlmjax_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_YAML = """task: dlmjax_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w9"]
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp('lm_eval')
  os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
  evaluate_test.make_word_run(root / 'run', seq_len=32)
  rows = [
    {'context': 'w1 w2', 'choices': [' w3', ' w4 w5'], 'label': 0, 'answer': 'w3'},
    {'context': 'w6 w7 w8', 'choices': [' w9', ' w10', ' w11'], 'label': 2, 'answer': 'w1'},
  ]
  data = root / 'rows.jsonl'
  data.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  tasks = root / 'tasks'
  tasks.mkdir()
  (tasks / 'mc.yaml').write_text(MC_YAML.format(data=data))
  (tasks / 'gen.yaml').write_text(GEN_YAML.format(data=data))
  return root, tasks


def test_simple_evaluate_runs_both_request_types(setup):
  root, tasks = setup
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel

  model_args = (
    f'checkpoint_path={root / "run"},mc_num=2,mc_batch=2,gen_length=4,steps=4,block_length=4'
  )
  results = lm_eval.simple_evaluate(
    model='dlmjax',
    model_args=model_args,
    tasks=['dlmjax_tiny_mc', 'dlmjax_tiny_gen'],
    task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
    batch_size=2,
    log_samples=True,
  )
  mc, gen = results['results']['dlmjax_tiny_mc'], results['results']['dlmjax_tiny_gen']
  assert 0.0 <= mc['acc,none'] <= 1.0 and 0.0 <= gen['exact_match,none'] <= 1.0
  # acc is the argmax of the adapter's log-likelihoods, which are finite and negative.
  samples = results['samples']['dlmjax_tiny_mc']
  for sample in samples:
    lls = [resp[0][0] for resp in sample['resps']]
    assert all(x < 0 for x in lls)
    assert sample['acc'] == float(lls.index(max(lls)) == sample['target'])
  for sample in results['samples']['dlmjax_tiny_gen']:
    assert 'w9' not in sample['filtered_resps'][0]  # cut at the stop string


def test_registered_under_dlmjax():
  from lm_eval.api.registry import get_model  # pylint: disable=import-outside-toplevel

  assert get_model('dlmjax') is lm_eval_adapter.DlmjaxLM


def test_local_file_tasks_score_as_dlmjax_evaluate(tmp_path):
  """dlmjax_gsm8k / _math500 / _humaneval from local files: lm-eval's per-sample metrics are
  dlmjax.tasks' metrics of the same completion (the prompts are the tasks' own)."""
  from lm_eval.tasks import TaskManager  # pylint: disable=import-outside-toplevel

  from dlmjax import tasks as tasks_lib  # pylint: disable=import-outside-toplevel
  from tests.tasks import code_exec_test  # pylint: disable=import-outside-toplevel

  files = {
    'gsm8k': [{'question': 'w1 w2?', 'answer': 'w3\n#### 4'}],
    'math500': [{'problem': 'w4?', 'solution': '\\boxed{w5}'}],
    'humaneval': [code_exec_test.HUMANEVAL],
  }
  entries = []
  for name, rows in files.items():
    path = tmp_path / f'{name}.jsonl'
    path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    entries.append((name, str(path)))
  directory = tmp_path / 'local'
  directory.mkdir()
  names = lm_eval_adapter.write_local_tasks(entries, str(directory))
  assert names == ['dlmjax_gsm8k', 'dlmjax_math500', 'dlmjax_humaneval']
  answers = {
    'w1 w2?': '<answer>\n4\n</answer>',
    'w4?': 'so \\boxed{w5}',
    'def add': '    return a + b\n',
  }

  class Fixed(lm_eval.api.model.LM):  # the model's side is test_simple_evaluate's: here the task's
    def generate_until(self, requests):
      return [next(v for k, v in answers.items() if k in r.args[0]) for r in requests]

    loglikelihood = loglikelihood_rolling = None

  results = lm_eval.simple_evaluate(
    model=Fixed(),
    tasks=names,
    task_manager=TaskManager(include_path=str(directory), include_defaults=False),
    batch_size=2,
    log_samples=True,
  )
  for (name, path), task_name in zip(entries, names):
    task = tasks_lib.get_task(name, data_path=f',{path}')
    example = task.examples('test', 1, 0)[0]
    (sample,) = results['samples'][task_name]
    assert sample['arguments'][0][0] == example.prompt  # lm-eval's request: the task's prompt
    expected = task.metrics([example], [sample['resps'][0][0]])
    assert {k: sample[k] for k in expected} == {k: v[0] for k, v in expected.items()}
    assert sample['accuracy'] == 1.0
    assert set(expected) <= {k.split(',')[0] for k in results['results'][task_name]}
  with pytest.raises(ValueError, match='not a file task'):
    lm_eval_adapter.write_local_tasks([('countdown3', 'x.jsonl')], str(directory))
