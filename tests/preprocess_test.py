"""The preprocess command line: Megatron's output names, and tokenizer training."""

import json

from dlmjax import preprocess
from dlmjax.data import indexed
from dlmjax.data import tokenizer as tokenizer_lib


def test_train_tokenizer_then_preprocess(tmp_path, capsys):
  data = tmp_path / 'data.jsonl'
  texts = ['for i in range(3):\n    print(i)\n', 'x = [1, 2, 3]\n'] * 30
  data.write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts) + '{"text": 5}\n')
  assert (
    preprocess.main(
      [
        'train-tokenizer',
        '--input',
        str(data),
        '--model-prefix',
        str(tmp_path / 'tok' / 'spm'),
        '--vocab-size',
        '300',
      ]
    )
    == 0
  )
  model = str(tmp_path / 'tok' / 'spm.model')
  assert 'mask_id=3' in capsys.readouterr().out
  assert (
    preprocess.main(
      [
        '--input',
        str(data),
        '--output-prefix',
        str(tmp_path / 'new' / 'out'),  # a directory that does not exist yet is made
        '--tokenizer',
        model,
        '--append-eod',
        '--log-interval',
        '0',
      ]
    )
    == 0
  )
  err = capsys.readouterr().err
  assert 'docs/s' in err and 'tokens/s' in err and 'line 61: ' in err
  ds = indexed.IndexedDataset(str(tmp_path / 'new' / 'out_text_document'))
  tok = tokenizer_lib.load_tokenizer(model)
  assert len(ds) == 60 and tok.decode(ds[1][:-1]) == texts[1] and ds[1][-1] == tok.eod_id
