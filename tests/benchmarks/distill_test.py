"""python -m benchmarks.distill's choice of teacher rows: --keep and --retries reach the rows'
command, each choice has its own rows and students, and a teacher with no row kept stops the
run in one line instead of a trace (the measuring itself runs in `--tiny`, README)."""

from benchmarks import distill as bench
from dlmjax import demo


def test_each_choice_of_rows_has_its_own_rows_and_student(tmp_path):
  work = ['--work-dir', str(tmp_path)]
  every = bench.stage_configs(bench._parser().parse_args(work))['distill_certainty']
  assert every.sft.teacher_file == str(tmp_path / 'teacher_rows.npz')  # earlier runs' names
  assert every.output_dir == str(tmp_path / 'distill_certainty')
  args = bench._parser().parse_args(work + ['--keep', 'correct', '--retries', '2'])
  correct = bench.stage_configs(args)['distill_certainty']
  assert correct.sft.teacher_file == str(tmp_path / 'teacher_rows_correct_retries2.npz')
  assert correct.output_dir == str(tmp_path / 'distill_certainty_correct_retries2')


def test_a_teacher_with_no_row_kept_stops_the_run_in_one_line(tmp_path, monkeypatch, capsys):
  calls = []

  def rows(teacher, path, sampling, task, **kwargs):
    calls.append((path, kwargs['keep'], kwargs['retries']))
    raise RuntimeError(f'no teacher rows in {path}: python -m dlmjax.distill failed (above).')

  monkeypatch.setattr(demo, 'write_teacher_rows', rows)
  monkeypatch.setattr(demo, 'write_sft_set', lambda *a, **k: None)
  monkeypatch.setattr(bench.sampler_accuracy, 'train_if_needed', lambda *a: None)
  argv = ['--tiny', '--work-dir', str(tmp_path), '--keep', 'correct', '--retries', '1']
  assert bench.main(argv) == 2
  assert calls == [(str(tmp_path / 'teacher_rows_correct_retries1.npz'), 'correct', 1)]
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: no student to distil: no teacher rows in') and '\n' not in err


def test_a_stage_cut_by_a_time_limit_stops_the_chain_in_one_line(tmp_path, monkeypatch, capsys):
  """A SIGTERM'd stage (checkpointed) must not hand its unfinished run to the next stage: the
  chain stops with exit 3 and one line saying the same command resumes it."""
  monkeypatch.setattr(demo, 'write_sft_set', lambda *a, **k: None)

  def cut(config, what):
    raise InterruptedError(
      f'{what} stopped at step 1 of 2; the same command resumes it from there.'
    )

  monkeypatch.setattr(bench.sampler_accuracy, 'train_if_needed', cut)
  assert bench.main(['--tiny', '--work-dir', str(tmp_path)]) == 3
  err = capsys.readouterr().err.strip()
  assert err.startswith('stopped: pretrain stopped at step 1') and '\n' not in err
