"""A tiny params-only run directory for the conversion, verification and inference tests."""

import json
import os

import jax
import numpy as np

from dlmjax import model as model_lib
from dlmjax.checkpoint import params_checkpoint
from tests.conftest import tiny_test_config


def tiny_config(**overrides):
  """2 layers, d_model 64, 4 heads over 2 kv heads (GQA), head_dim 16, ffn 128, vocab 256."""
  return tiny_test_config(**{'model.vocab_size': 256, **overrides})


def random_params(config, seed=0):
  """Params whose every entry is random (norm scales too, so a mixed-up norm shows)."""
  cfg = model_lib.ModelConfig.from_config(config)
  params = model_lib.init_params(cfg, jax.random.key(seed))
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda x: np.asarray(x + 0.1 * rng.standard_normal(x.shape), np.float32), params
  )


def make_run(directory, seed=0, **overrides):
  """(config, numpy params, step_dir) of a params-only run saved under `directory`."""
  config = tiny_config(**overrides)
  config.output_dir = str(directory)
  params = random_params(config, seed)
  step_dir = params_checkpoint.save_params_checkpoint(str(directory), config, params)
  return config, params, step_dir


def write_tokenizer(directory, size=256) -> str:
  """A Hugging Face tokenizer.json with `size` ids (a word-level one) in `directory`."""
  import tokenizers  # pylint: disable=import-outside-toplevel

  vocab = {f't{i}': i for i in range(size)}
  os.makedirs(directory, exist_ok=True)
  tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='t0')).save(
    os.path.join(directory, 'tokenizer.json')
  )
  return str(directory)


def assert_same_params(a, b):
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def flip_bytes(directory):
  """Bit rot in the largest data file of an item (orbax's ocdbt `d/` files hold the arrays)."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs if d.endswith('/d')]
  target = max(files, key=os.path.getsize)
  with open(target, 'r+b') as f:
    f.seek(os.path.getsize(target) // 2)
    chunk = f.read(64)
    f.seek(os.path.getsize(target) // 2)
    f.write(bytes(b ^ 0x01 for b in chunk))


def edit_meta(step_dir, drop=(), **changes):
  path = os.path.join(step_dir, 'meta', 'metadata')
  with open(path) as f:
    meta = json.load(f)
  meta.update(changes)
  for key in drop:
    del meta[key]
  with open(path, 'w') as f:
    json.dump(meta, f)


def truncate_arrays(directory):
  """Cuts the largest data file of an item to a third (a copy or write cut short)."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs if d.endswith('/d')]
  target = max(files, key=os.path.getsize)
  os.truncate(target, os.path.getsize(target) // 3)
