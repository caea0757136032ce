"""SDAR / TraDo in exactly: a tiny random-weight directory laid out as JetAstra/SDAR ships
SDAR-*-Chat (config.json of SDARConfig's fields, model_type 'sdar', Qwen3 tensor names) imports
through `convert from-hf`, `load_pretrained` and `init_from` into a block-causal model whose logits
are SDAR's forward, and `convert to-hf` writes it back as SDAR lays it out (hf_layouts: sdar).

The reference is transformers' Qwen3ForCausalLM over the same tensors with SDAR's attention mask
put in: modeling_sdar.py's SDARAttention is Qwen3Attention line for line (q/k RMSNorm over the head
dim before rotate-half RoPE, scale head_dim^-0.5, GQA, biases only with attention_bias), its
decoder layer, RMSNorm (float32 statistics, gain after the cast back) and rotary table are Qwen3's,
and only the mask differs: block_diff_mask's clean-stream term, a query at i sees key j iff
i // block_size >= j // block_size (the inference mask of SDAR's generate.py). The mask is written
here from that formula, not taken from dlmjax.
"""

import os

import numpy as np
import pytest

from dlmjax import convert
from dlmjax import inference
from dlmjax import model as model_lib
from dlmjax.checkpoint import hf_config
from dlmjax.checkpoint.families import sdar
from dlmjax.checkpoint import hf_io
from dlmjax.checkpoint import params_checkpoint
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.checkpoint import step_meta
from tests.checkpoint import family_dirs
from tests.checkpoint import tiny_run

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

BLOCK = family_dirs.SDAR_BLOCK
SDAR_CONFIG = family_dirs.SDAR_CONFIG
sdar_dir = family_dirs.sdar_dir
_ATTENTION = 'sdar_block_causal_test'


def _sdar_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
  """SDAR's attention: softmax over the keys of blocks <= the query's block (fp32 scores)."""
  del attention_mask, kwargs
  length = query.shape[2]
  i = torch.arange(length)
  visible = (i[:, None] // module.config.sdar_block_size) >= (
    i[None, :] // module.config.sdar_block_size
  )
  group = query.shape[1] // key.shape[1]
  key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
  scores = torch.einsum('bnqh,bnkh->bnqk', query.float(), key.float()) * scaling
  probs = scores.masked_fill(~visible, float('-inf')).softmax(-1)
  return torch.einsum('bnqk,bnkh->bqnh', probs, value.float()).contiguous(), None


def reference_model(hf_dir: str, block_size: int = BLOCK):
  """SDAR's model: Qwen3ForCausalLM over the directory's tensors, SDAR's block-causal mask."""
  transformers.AttentionInterface.register(_ATTENTION, _sdar_attention)
  hf = hf_config.read(hf_dir)
  config = transformers.Qwen3Config(
    **{
      k: hf[k]
      for k in (
        'vocab_size',
        'hidden_size',
        'intermediate_size',
        'head_dim',
        'num_hidden_layers',
        'num_attention_heads',
        'num_key_value_heads',
        'max_position_embeddings',
        'rms_norm_eps',
        'tie_word_embeddings',
      )
    },
    rope_theta=float(hf['rope_theta']),
  )
  config.sdar_block_size = block_size
  config._attn_implementation = _ATTENTION  # pylint: disable=protected-access
  model = transformers.Qwen3ForCausalLM(config)
  from safetensors.torch import load_file  # pylint: disable=import-outside-toplevel

  state = load_file(os.path.join(hf_dir, 'model.safetensors'))
  model.load_state_dict(state, strict=not hf['tie_word_embeddings'])
  return model.eval()


def reference_logits(hf_dir: str, tokens, block_size: int = BLOCK) -> np.ndarray:
  """SDAR's forward of the directory (reference_model)."""
  model = reference_model(hf_dir, block_size)
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens), use_cache=False).logits.numpy()


def _ours(config, params, tokens):
  return np.asarray(model_lib.merge(model_lib.ModelConfig.from_config(config), params)(tokens))


def _close(theirs, ours):
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4 * np.abs(ours).max())


@pytest.mark.parametrize('tied', [False, True])
def test_sdar_directory_imports_to_sdar_function(tmp_path, tied):
  hf_dir = sdar_dir(tmp_path / 'hf', tied=tied)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  theirs = reference_logits(hf_dir, tokens)

  run_dir = str(tmp_path / 'run')
  assert convert.main(['from-hf', '--hf-dir', hf_dir, '--output-dir', run_dir]) == 0
  _, step_dir, _ = run_dir_lib.resolve_step_dir(run_dir)
  config = run_dir_lib.load_run_config(run_dir)
  params = params_checkpoint.restore_params(step_dir, *model_lib.param_placement(config))
  m = config.model
  assert (m.attention_mask, m.block_size, m.qk_norm, m.qkv_bias) == ('block_causal', 4, True, False)
  assert (m.mask_token_id, m.eos_token_id, m.pad_token_id) == (250, 2, 2)
  assert (m.rope_theta, m.norm_eps, m.tie_embeddings, m.head_dim) == (1e6, 1e-6, tied, 16)
  assert step_meta.read_meta(step_dir)['source']['family'] == 'sdar'
  _close(theirs, _ours(config, params, tokens))
  pretrained = inference.load_pretrained(hf_dir)
  _close(theirs, _ours(pretrained.config, pretrained.params, tokens))

  # The parity can fail: another block size, or bidirectional attention, is another function.
  for wrong in (dict(block_size=8), dict(attention_mask='bidirectional')):
    other = config.copy_and_resolve_references()
    other.model.update(wrong)
    with pytest.raises(AssertionError):
      _close(theirs, _ours(other, params, tokens))

  # Back out (`convert to-hf`, layout source: SDAR's): SDAR's config.json field for field, its
  # auto_map naming SDAR's classes in its Hub repository (the code is SDAR's, not shipped here),
  # its tensors bit for bit, and SDAR's forward of the export is the source's.
  export = str(tmp_path / 'export')
  argv = ['to-hf', '--checkpoint-path', run_dir, '--output-dir', export, '--dtype', 'fp32']
  assert convert.main(argv) == 0
  source, exported = hf_config.read(hf_dir), hf_config.read(export)
  assert exported['auto_map'] == {
    k: f'{sdar.CODE_REPO}--{v}' for k, v in source['auto_map'].items()
  }
  skip = ('auto_map', 'transformers_version')
  assert {k: v for k, v in exported.items() if k not in skip} == {
    k: v for k, v in source.items() if k not in skip
  }
  safetensors_torch = pytest.importorskip('safetensors.torch')
  files = [
    safetensors_torch.load_file(os.path.join(d, 'model.safetensors')) for d in (hf_dir, export)
  ]
  assert sorted(files[0]) == sorted(files[1])
  assert all(torch.equal(files[0][name], files[1][name]) for name in files[0])
  np.testing.assert_array_equal(reference_logits(export, tokens), theirs)


def test_init_from_an_sdar_directory_adopts_block_causal_attention(tmp_path):
  from dlmjax.checkpoint import init_from  # pylint: disable=import-outside-toplevel

  hf_dir = sdar_dir(tmp_path / 'hf')
  config = tiny_run.tiny_config(**{'init_from': hf_dir})
  changed = set(init_from.adopt_source_config(config))
  assert {"model.attention_mask='block_causal'", 'model.block_size=4'} <= changed
  _, params = hf_io.load_hf(hf_dir, config=config)
  tiny_run.assert_same_params(hf_io.load_hf(hf_dir)[1], params)


def test_sdar_moe_is_refused_in_one_line():
  for hf in (
    dict(SDAR_CONFIG, model_type='sdar_moe', architectures=['SDARMoeForCausalLM']),
    dict(SDAR_CONFIG, num_experts=128),
  ):
    with pytest.raises(hf_config.HFConfigError, match='SDAR mixture-of-experts') as e:
      hf_config.config_from_hf(hf)
    assert '\n' not in str(e.value)


def test_sdar_8b_config_imports_as_the_sdar_8b_preset():
  """SDAR-8B-Chat's own config.json values give the preset's model exactly."""
  hf = dict(
    SDAR_CONFIG,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=32768,
    bos_token_id=151643,
    eos_token_id=151643,
    mask_token_id=151669,
  )
  config = hf_config.config_from_hf(hf)
  preset = model_lib.PRESETS['sdar_8b']
  assert {k: config.model[k] for k in preset if k != 'seq_len'} == {
    k: v for k, v in preset.items() if k != 'seq_len'
  }


def test_hub_sdar_4b_config_without_mask_or_block_fields_imports_as_the_preset():
  """JetLM/SDAR-4B-Chat's config.json on the Hub has no mask_token_id and no block_size (the
  GitHub training copy has both): the import takes SDAR's <|MASK|> 151669 and block 4."""
  hf = dict(
    SDAR_CONFIG,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=32768,
    max_window_layers=36,
    bos_token_id=151643,
    eos_token_id=151643,
  )
  del hf['mask_token_id'], hf['block_size']
  config = hf_config.config_from_hf(hf)
  preset = model_lib.PRESETS['sdar_4b']
  assert {k: config.model[k] for k in preset if k != 'seq_len'} == {
    k: v for k, v in preset.items() if k != 'seq_len'
  }
  assert (config.model.mask_token_id, config.model.block_size) == (151669, 4)


def sdar_greedy_generate(model, prompt, *, gen_length, threshold, mask_id, eos_id):
  """SDAR's block_diffusion_generate (generate.py) for one prompt, greedy, block_length =
  denoising steps = the model's block (one token per step, low_confidence_dynamic): the prompt's
  whole blocks are the prefix, its rest opens the first block; per step x0 = argmax, c = p(x0),
  commit every c > threshold if any, else the most confident; stop after the block where EOS
  appears. No K/V cache: every step a forward of the whole prefix, which SDAR's mask makes the
  cached forward. One change: MASK is never predicted (dlmjax's sampler bans it)."""
  n, block = len(prompt), BLOCK
  total = -(-(n + gen_length) // block) * block
  x = torch.full((1, total), mask_id, dtype=torch.long)
  x[0, :n] = torch.as_tensor(prompt)
  # One torch thread: on shared cores its two-thread pool waits on busy ones (this loop took 38 s
  # instead of 1 s); the pool's size is put back after.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    _sdar_blocks(model, x, n, total, threshold=threshold, mask_id=mask_id, eos_id=eos_id)
  finally:
    torch.set_num_threads(threads)
  row = x[0, n : n + gen_length].tolist()
  return row[: row.index(eos_id)] if eos_id in row else row


def _sdar_blocks(model, x, n, total, *, threshold, mask_id, eos_id):
  """sdar_greedy_generate's block loop over the canvas x [1, total], in place."""
  block = BLOCK
  with torch.no_grad():
    for lo in range(n // block * block, total, block):
      while (x[0, lo : lo + block] == mask_id).any():
        logits = model(input_ids=x[:, : lo + block], use_cache=False).logits[0, lo:]
        logits[:, mask_id] = -torch.inf
        probs = logits.double().softmax(-1)
        conf, x0 = probs.max(-1)
        masked = x[0, lo : lo + block] == mask_id
        conf = torch.where(masked, conf, -torch.inf)
        commit = masked & (conf > threshold)
        if not commit.any():
          commit = torch.zeros_like(masked)
          commit[conf.argmax()] = True
        x[0, lo : lo + block] = torch.where(commit, x0, x[0, lo : lo + block])
      if (x[0, n : lo + block] == eos_id).any():
        break


@pytest.mark.slow  # ~22 s on 2 shared cores: the sampler's compile
def test_an_sdar_checkpoint_samples_with_the_block_cache_as_sdar_does(tmp_path):
  """load_pretrained(SDAR dir).generate_tokens with the block cache, prompts of lengths that are
  not multiples of the block, stop at EOS: SDAR's greedy block decoding token for token."""
  hf_dir = sdar_dir(tmp_path / 'hf')
  pretrained = inference.load_pretrained(hf_dir)
  m = pretrained.config.model
  rng = np.random.default_rng(3)
  prompts = [rng.integers(4, 200, size).tolist() for size in (3, 6, 9, 4)]
  model = reference_model(hf_dir)
  # As EOS, a token SDAR writes early in the first row, so that stopping is exercised.
  eos_id = sdar_greedy_generate(
    model, prompts[0], gen_length=16, threshold=0.4, mask_id=m.mask_token_id, eos_id=-1
  )[6]
  m.eos_token_id = eos_id  # generate_tokens reads it
  ours = pretrained.generate_tokens(
    prompts,
    batch_size=4,
    gen_length=16,
    steps=16,
    block_length=BLOCK,
    temperature=0.0,
    threshold=0.4,
    cache='block',
    stop_at_eos=True,
  )
  theirs = [
    sdar_greedy_generate(
      model, p, gen_length=16, threshold=0.4, mask_id=m.mask_token_id, eos_id=eos_id
    )
    for p in prompts
  ]
  assert ours == theirs
  assert len(theirs[0]) <= 6


def test_only_a_block_causal_qk_norm_model_exports_as_sdar():
  config = hf_config.config_from_hf(SDAR_CONFIG)
  assert sdar.options_cannot_hold(config.model) is None
  for change, named in (
    (dict(attention_mask='bidirectional'), 'attends block-causally'),
    (dict(qk_norm=False), 'has QK-norm'),
    (dict(qkv_bias=True), 'no q/k/v-only biases'),
  ):
    other = config.copy_and_resolve_references()
    other.model.update(change)
    with pytest.raises(hf_config.HFConfigError, match=named):
      sdar.write(other, vocab_rows=256, dtype='fp32')
