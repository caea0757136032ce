"""The exported tokenizer through transformers' AutoTokenizer is dlmjax's tokenizer: the same ids
and the text back exactly (spaces, indentation, code, Unicode), with the model's EOS, padding and
mask tokens set, for a SentencePiece model and for a tokenizer.json."""

import json
import os

import pytest

from dlmjax.checkpoint import hf_io
from dlmjax.data import tokenizer as tokenizer_lib
from tests.checkpoint import tiny_run

transformers = pytest.importorskip('transformers')

TEXTS = [
  'def main(argv):\n    return  run(argv) + 1  # two spaces\n',
  '  leading and trailing  ',
  'class Point:\n\tx: int = 0\n\n\n',
  'naïve café, Ça va? 中文 🙂 Ω≈ç',
  'x' * 40 + ' 12345 678.9',
]


@pytest.fixture(scope='module')
def spm_path(tmp_path_factory):
  prefix = tmp_path_factory.mktemp('spm') / 'tok'
  return tokenizer_lib.train_sentencepiece(TEXTS * 20, str(prefix), vocab_size=320)


@pytest.fixture(scope='module')
def json_dir(tmp_path_factory):
  """A byte-level BPE tokenizer.json with <|endoftext|> and <|mask|>, as Qwen's are built."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import decoders, models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=['<|endoftext|>', '<|mask|>', '<|pad|>'],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(TEXTS * 20, trainer)
  directory = tmp_path_factory.mktemp('json_tok')
  tok.save(str(directory / 'tokenizer.json'))
  return str(directory)


def _export(tmp_path, tokenizer, **ids):
  ours = tokenizer_lib.load_tokenizer(tokenizer)
  overrides = {
    'data.tokenizer': tokenizer,
    'model.vocab_size': 320,
    'model.eos_token_id': ours.eod_id,
    'model.pad_token_id': ours.pad_id,
    'model.mask_token_id': ours.mask_id,
    **ids,
  }
  config = tiny_run.tiny_config(**overrides)
  out = str(tmp_path / 'hf')
  hf_io.write_hf(out, config, tiny_run.random_params(config), dtype='fp32')
  return ours, out


@pytest.mark.parametrize('kind', ['sentencepiece', 'tokenizer_json'])
def test_autotokenizer_is_our_tokenizer(tmp_path, spm_path, json_dir, kind):
  ours, out = _export(tmp_path, spm_path if kind == 'sentencepiece' else json_dir)
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  exported = tokenizer_lib.load_tokenizer(out)  # what dlmjax reads from the export
  for text in TEXTS:
    ids = ours.encode(text)
    assert theirs(text)['input_ids'] == ids, text
    assert theirs.decode(ids) == text == ours.decode(ids)
    assert exported.encode(text) == ids
  assert (theirs.eos_token_id, theirs.pad_token_id, theirs.mask_token_id) == (
    ours.eod_id,
    ours.pad_id,
    ours.mask_id,
  )


def test_copied_tokenizer_config_keeps_its_fields_and_takes_the_model_ids(tmp_path, json_dir):
  """A tokenizer_config.json beside the tokenizer (a chat template, its class) is kept; the
  special tokens become the model's (here padding with <|endoftext|>)."""
  source = tmp_path / 'src'
  source.mkdir()
  for name in ('tokenizer.json',):
    with open(os.path.join(json_dir, name)) as f, open(source / name, 'w') as g:
      g.write(f.read())
  template = '{% for m in messages %}{{ m.content }}{% endfor %}'
  (source / 'tokenizer_config.json').write_text(
    json.dumps(dict(chat_template=template, eos_token='<|pad|>'))
  )
  ours, out = _export(tmp_path, str(source), **{'model.pad_token_id': 0})
  theirs = transformers.AutoTokenizer.from_pretrained(out)
  assert theirs.chat_template == template
  assert (theirs.eos_token_id, theirs.pad_token_id, theirs.mask_token_id) == (0, 0, 1)
