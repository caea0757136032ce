"""python -m dlmjax.generate and load_pretrained(...).generate: the sampler behind a checkpoint."""

import json
import os

import jax
import numpy as np
import pytest

import dlmjax
from dlmjax import generate
from dlmjax.data import chat
from dlmjax.diffusion import prompt_rows, sampler_programs, sampling_config
from tests.checkpoint import tiny_run

SAMPLING = dict(gen_length=8, steps=4, block_length=4, temperature=0.7, batch_size=2)
FLAGS = [
  '--gen-length',
  '8',
  '--steps',
  '4',
  '--block-length',
  '4',
  '--temperature',
  '0.7',
  '--batch-size',
  '2',
]


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  import tokenizers  # pylint: disable=import-outside-toplevel

  root = tmp_path_factory.mktemp('generate')
  tokenizer = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({f't{i}': i for i in range(256)}, unk_token='t1')
  )
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(root / 'tokenizer.json'))
  tiny_run.make_run(root / 'run', **{'data.tokenizer': str(root / 'tokenizer.json')})
  return root, dlmjax.load_pretrained(str(root / 'run'))


def test_generate_is_the_sampler(run):
  _, model = run
  prompts = [[5, 6, 7], [8, 9], [10]]
  got = model.generate_tokens(prompts, seed=3, **SAMPLING)
  m = model.config.model
  settings = {k: v for k, v in SAMPLING.items() if k != 'batch_size'}
  fn = sampler_programs.make_generate_fn(
    model.model_config,
    sampling_config.SamplingConfig(**settings),
    mask_id=m.mask_token_id,
    eos_id=m.eos_token_id,
    pad_id=m.pad_token_id,
    vocab_size=m.vocab_size,
    mesh=None,
  )
  expected = []
  for start in (0, 2):
    chunk = (prompts[start : start + 2] + [prompts[-1]])[:2]
    out = np.asarray(
      fn(
        model.params,
        *prompt_rows.pad_prompts(chunk, m.pad_token_id, 3),
        jax.random.fold_in(jax.random.key(3), start),
      )
    )
    assert (out != m.mask_token_id).all()  # every position decoded, whatever the tokens are
    expected += prompt_rows.completions(out, 3, m.eos_token_id)
  assert got == expected[:3]
  assert all(0 <= t < m.vocab_size and t != m.mask_token_id for row in got for t in row)


def test_text_and_chat_template(run):
  _, model = run
  text = model.generate('t5 t6 t7', seed=1, **SAMPLING)
  ids = model.tokenizer.encode('t5 t6 t7')
  assert ids == [5, 6, 7] and model.chat_template == 'none'
  assert text == [model.tokenizer.decode(model.generate_tokens([ids], seed=1, **SAMPLING)[0])]
  model.config.stage = 'sft'
  try:
    template = model.config.sft.chat_template
    wrapped = model.tokenizer.encode(chat.prompt_text(template, 't5'))
    assert len(wrapped) == 3 and 5 in wrapped  # 'User: t5\nAssistant: '
    assert model.generate('t5', seed=1, **SAMPLING) == [
      model.tokenizer.decode(model.generate_tokens([wrapped], seed=1, **SAMPLING)[0])
    ]
  finally:
    model.config.stage = 'pretrain'


def test_cli_prompt_and_prompts_file(run, tmp_path, capsys):
  root, model = run
  path = str(root / 'run')
  assert (
    generate.main(['--checkpoint-path', path, '--prompt', 't5 t6 t7', '--seed', '1'] + FLAGS) == 0
  )
  assert capsys.readouterr().out == model.generate('t5 t6 t7', seed=1, **SAMPLING)[0] + '\n'
  rows = [{'prompt': 't5 t6', 'id': 1}, {'prompt': 't7'}, {'prompt': 't8 t9 t10'}]
  (tmp_path / 'in.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  out = tmp_path / 'new' / 'out.jsonl'  # a directory that does not exist yet is made
  assert (
    generate.main(
      [
        '--checkpoint-path',
        path,
        '--prompts-file',
        str(tmp_path / 'in.jsonl'),
        '--output',
        str(out),
      ]
      + FLAGS
    )
    == 0
  )
  written = [json.loads(line) for line in out.read_text().splitlines()]
  texts = model.generate([r['prompt'] for r in rows], **SAMPLING)
  assert written == [{**r, 'completion': t} for r, t in zip(rows, texts)]


@pytest.mark.parametrize(
  'extra,message',
  [
    (['--prompt', 'x', '--gen-length', '10', '--block-length', '4'], 'multiple of block_length'),
    (
      ['--prompt', 'x', '--gen-length', '8', '--block-length', '4', '--steps', '3'],
      'multiple of the 2 blocks',
    ),
    (['--prompt', 'x', '--remasking', 'sideways'], 'not a decoding order'),
    (
      [
        '--prompt',
        ' '.join(['t5'] * 30),
        '--gen-length',
        '8',
        '--steps',
        '8',
        '--block-length',
        '8',
      ],
      'exceeds the model context',
    ),
    (['--prompts-file', 'MISSING'], 'MISSING'),
  ],
)
def test_bad_input_is_one_error_line(run, capsys, extra, message):
  root, _ = run
  assert generate.main(['--checkpoint-path', str(root / 'run')] + extra) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and message in err


def test_bad_prompts_file(run, tmp_path, capsys):
  root, _ = run
  (tmp_path / 'bad.jsonl').write_text('{"text": "no prompt"}\n')
  assert (
    generate.main(
      ['--checkpoint-path', str(root / 'run'), '--prompts-file', str(tmp_path / 'bad.jsonl')]
    )
    == 2
  )
  assert 'bad.jsonl:1 has no "prompt"' in capsys.readouterr().err
  assert os.path.exists(root / 'run')
