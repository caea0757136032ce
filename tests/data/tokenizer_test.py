"""Tokenizer loading, special-id resolution and SentencePiece training on tiny inputs."""

import json
import pickle

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from dlmjax.data import tokenizer as tokenizer_lib
from dlmjax.data.errors import DataError

TEXTS = [
  'def add(a, b):\n    return a + b\n',
  'class Point:\n    """A point."""\n\n    x: int = 0\n',
  'The quick brown fox jumps over the lazy dog.\n' * 3,
] * 20


@pytest.fixture(scope='module')
def spm_path(tmp_path_factory):
  prefix = tmp_path_factory.mktemp('spm') / 'tok'
  return tokenizer_lib.train_sentencepiece(TEXTS, str(prefix), vocab_size=320)


def _hf_json(tmp_path, specials):
  tok = tokenizers.Tokenizer(models.BPE(unk_token='[UNK]'))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
  path = str(tmp_path / 'tokenizer.json')
  tok.save(path)
  return path


def test_sentencepiece_special_ids_and_round_trip(spm_path):
  tok = tokenizer_lib.load_tokenizer(spm_path)
  assert (tok.pad_id, tok.eod_id, tok.mask_id) == (0, 2, 3)
  assert tok.piece_id('<unk>') == 1 and tok.piece_id('\n') == 4
  assert tok.vocab_size == 320
  text = 'def f(x):\n\treturn  x  # é 漢\n\n'  # tabs, double spaces, unseen characters.
  assert tok.decode(tok.encode(text)) == text
  assert tok.encode_batch([text, 'a']) == [tok.encode(text), tok.encode('a')]


def test_sentencepiece_training_is_deterministic(spm_path, tmp_path):
  again = tokenizer_lib.train_sentencepiece(TEXTS, str(tmp_path / 'again'), vocab_size=320)
  assert open(again, 'rb').read() == open(spm_path, 'rb').read()


def test_train_from_jsonl_and_too_small_vocab(tmp_path):
  path = tmp_path / 'data.jsonl'
  path.write_text(''.join(json.dumps({'text': t}) + '\n' for t in TEXTS) + 'not json\n')
  model = tokenizer_lib.train_sentencepiece(str(path), str(tmp_path / 'j'), vocab_size=300)
  assert tokenizer_lib.load_tokenizer(model).vocab_size == 300
  with pytest.raises(DataError, match='lower vocab_size'):
    tokenizer_lib.train_sentencepiece(TEXTS, str(tmp_path / 'big'), vocab_size=100_000)


def test_huggingface_json_resolves_pieces(tmp_path):
  path = _hf_json(tmp_path, ['<|endoftext|>', '<|padding|>', '<|mask|>', '[UNK]'])
  tok = tokenizer_lib.load_tokenizer(str(tmp_path))  # a directory holding tokenizer.json.
  assert (tok.eod_id, tok.pad_id, tok.mask_id) == (0, 1, 2)
  assert tok.decode(tok.encode('return a + b')) == 'return a + b'
  tok = pickle.loads(pickle.dumps(tok))
  assert tok.mask_id == 2 and tok.encode('a') == tokenizer_lib.load_tokenizer(path).encode('a')


def test_overrides_and_missing_mask(tmp_path):
  path = _hf_json(tmp_path, ['<|endoftext|>', '[UNK]', '<M>'])
  with pytest.raises(DataError, match=r'no mask token found .*mask_token=.*--mask-token'):
    tokenizer_lib.load_tokenizer(path)
  tok = tokenizer_lib.load_tokenizer(path, mask_token='<M>')
  assert (tok.mask_id, tok.pad_id) == (2, tok.eod_id)  # pad falls back to end-of-document.
  assert tokenizer_lib.load_tokenizer(path, mask_token=7, eod_token='[UNK]').eod_id == 1
  assert tokenizer_lib.load_tokenizer(path, require_mask=False).mask_id is None
  with pytest.raises(DataError, match="'<nope>' is not a piece"):
    tokenizer_lib.load_tokenizer(path, mask_token='<nope>')
  with pytest.raises(DataError, match='no tokenizer at'):
    tokenizer_lib.load_tokenizer(str(tmp_path / 'missing.model'))
