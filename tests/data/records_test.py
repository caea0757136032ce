"""Data sources through Hugging Face `datasets`: parquet, json, arrow, csv, cached hub names, with
the data.columns mapping; our jsonl reader keeps naming lines; SFT and RL read them alike."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlmjax import tasks
from dlmjax.data import records
from dlmjax.train import sft_rows as sft
from dlmjax.data.errors import DataError

ROWS = [{'question': f'q{i}?', 'answer': f'step\n#### {i}'} for i in range(3)]


def _write(tmp_path, kind):
  table = pa.Table.from_pylist(ROWS)
  path = tmp_path / f'rows.{kind}'
  if kind == 'parquet':
    pq.write_table(table, path)
  elif kind == 'jsonl':
    path.write_text(''.join(json.dumps(r) + '\n' for r in ROWS))
  elif kind == 'json':
    path.write_text(json.dumps(ROWS))
  elif kind == 'arrow':
    with pa.ipc.new_stream(path, table.schema) as writer:
      writer.write_table(table)
  elif kind == 'csv':
    import pyarrow.csv as pacsv

    pacsv.write_csv(table, path)
  return str(path)


@pytest.mark.parametrize('kind', ['parquet', 'jsonl', 'json', 'arrow', 'csv'])
def test_every_file_kind_reads_the_same_rows(tmp_path, kind):
  path = _write(tmp_path, kind)
  rows = list(records.read_records(path, columns='prompt=question,response=answer'))
  assert [r for _, r in rows] == [{'prompt': r['question'], 'response': r['answer']} for r in ROWS]
  assert rows[1][0] == (f'{path}:2' if kind == 'jsonl' else f'{path}#1')


def test_directory_and_glob_sources(tmp_path):
  (tmp_path / 'd').mkdir()
  for i in range(2):
    pq.write_table(pa.Table.from_pylist(ROWS[i : i + 1]), tmp_path / 'd' / f'part{i}.parquet')
  assert [r['question'] for _, r in records.read_records(str(tmp_path / 'd'))] == ['q0?', 'q1?']
  assert len(list(records.read_records(str(tmp_path / 'd' / '*.parquet')))) == 2


def test_sft_and_rl_read_a_parquet_with_mapped_columns(tmp_path):
  path = _write(tmp_path, 'parquet')
  rows = sft.read_conversations(path, 'plain', 'prompt=question,response=answer')
  assert 'q0?' in rows[0][1] and rows[0][2] == ROWS[0]['answer']
  task = tasks.get_task('gsm8k', data_path=path)
  assert sorted(e.answer for e in task.examples('train', 3, seed=0)) == ['0', '1', '2']
  renamed = tmp_path / 'renamed.parquet'
  pq.write_table(
    pa.Table.from_pylist([{'q': r['question'], 'a': r['answer']} for r in ROWS]), renamed
  )
  task = tasks.get_task('gsm8k', data_path=str(renamed), columns='question=q,answer=a')
  assert len(task.examples('train', 3, seed=0)) == 3


@pytest.mark.parametrize(
  'source, columns, message',
  [
    ('{tmp}/missing.parquet', '', 'is not a file, directory or glob'),
    ('{tmp}/rows.parquet', 'prompt', 'not OURS=THEIRS'),
    ('{tmp}/rows.parquet', 'prompt=nope', "names \\['nope'\\]"),
    ('hub:no-such-org/no-such-set', '', 'not in the local `datasets` cache'),
  ],
)
def test_bad_sources_name_the_problem(tmp_path, source, columns, message):
  _write(tmp_path, 'parquet')
  with pytest.raises(DataError, match=message):
    list(records.read_records(source.format(tmp=tmp_path), columns=columns))


def test_hub_names_read_the_cache_only_with_config_and_split(monkeypatch):
  import datasets

  calls = []

  def fake_load(name, subset, split, download_mode):
    calls.append((name, subset, split, download_mode))
    return [{'q': 'x', 'a': 'y'}]

  monkeypatch.setattr(datasets, 'load_dataset', fake_load)
  rows = list(records.read_records('hub:openai/gsm8k:main@test', columns='question=q,answer=a'))
  assert rows == [('hub:openai/gsm8k:main@test#0', {'question': 'x', 'answer': 'y'})]
  list(records.read_records('hub:HuggingFaceH4/MATH-500'))
  assert calls == [
    ('openai/gsm8k', 'main', 'test', 'reuse_cache_if_exists'),
    ('HuggingFaceH4/MATH-500', None, 'train', 'reuse_cache_if_exists'),
  ]


def test_a_saved_dataset_directory(tmp_path):
  import datasets

  datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / 'saved'))
  assert [r['question'] for _, r in records.read_records(str(tmp_path / 'saved'))] == [
    'q0?',
    'q1?',
    'q2?',
  ]
