"""The reward stage end to end (from a language model, on the built-in pairs, evaluated on the
held-out ones), LoRA with the score head trained whole, and the export transformers' own
*ForSequenceClassification class reads to the same scores."""

import json
import os

import jax
import numpy as np
import pytest

from dlmjax import convert, generate, inference
from dlmjax import model as model_lib
from dlmjax import verify
from dlmjax.checkpoint import hf_config, hf_io, hf_layouts, params_checkpoint, peft_io, run_model
from dlmjax.checkpoint import run_dir as run_dir_lib
from dlmjax.model import lora, score_head
from dlmjax.parallel import mesh as mesh_lib
from dlmjax.rl import reward_model
from dlmjax.train import loop, stages
from dlmjax.train import state as state_lib
from tests import stage_configs
from tests.conftest import tiny_test_config

SEQ = 96  # every built-in pair fits


@pytest.fixture(scope='module')
def reward_run(tmp_path_factory):
  """(config, run dir) of 4 reward steps from a random language model, evaluated at 2 and 4."""
  init = str(tmp_path_factory.mktemp('init'))
  c = tiny_test_config(**{'model.seq_len': SEQ, 'output_dir': init})
  cfg = model_lib.ModelConfig.from_config(c)
  params_checkpoint.save_params_checkpoint(init, c, model_lib.init_params(cfg, jax.random.key(0)))
  out = str(tmp_path_factory.mktemp('reward'))
  config = stage_configs.with_cache(
    tiny_test_config(
      **{
        'stage': 'reward',
        'init_from': init,
        'output_dir': out,
        'model.seq_len': SEQ,
        'train.steps': 4,
        'train.schedule': 'constant',
        'train.warmup_steps': 0,
        'train.lr': 1e-3,
        'eval.every': 2,
        'eval.batches': 2,
        'log.outputs': '',
      }
    )
  )
  loop.train(config)
  return config, out


def test_a_reward_run_trains_a_score_head_and_evaluates_held_out_pairs(reward_run):
  config, out = reward_run
  rows = [json.loads(line) for line in open(os.path.join(out, 'metrics.jsonl'))]
  train = [r for r in rows if 'reward_accuracy' in r]
  val = [r for r in rows if 'val_reward_accuracy' in r]
  assert [r['step'] for r in train] == [1, 2, 3, 4]
  assert all(np.isfinite(r['loss']) and np.isfinite(r['margin']) for r in train)
  assert [r['step'] for r in val] == [2, 4] and all(r['val_pairs'] == 32 for r in val)
  setup = state_lib.TrainSetup(config, mesh_lib.make_mesh(config))
  loaded = run_model.restore(out, setup.mesh)
  assert loaded.model_config.score_head
  assert 'score' in loaded.params and 'lm_head' not in loaded.params
  # The logged held-out numbers are the restored model's scores of those pairs.
  evaluator = stages.build(config).evaluator(setup)
  margins = evaluator.margins(loaded.params)
  assert val[-1]['val_reward_accuracy'] == pytest.approx(float((margins > 0).mean()))
  assert val[-1]['val_margin'] == pytest.approx(float(margins.mean()), rel=1e-4, abs=1e-6)


def test_transformers_sequence_classification_reads_the_export_to_our_scores(reward_run, tmp_path):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  config, out = reward_run
  hf_dir = hf_io.hf_from_checkpoint(out, str(tmp_path / 'hf'), dtype='fp32', copy_tokenizer=False)
  hf = hf_config.read(hf_dir)
  assert hf['architectures'] == ['Qwen3ForSequenceClassification']
  assert hf['pad_token_id'] == config.model.eos_token_id
  assert not os.path.exists(os.path.join(hf_dir, hf_config.MODELING_FILE))
  loaded = run_model.restore(out)
  eos = config.model.eos_token_id
  rows = np.random.default_rng(0).integers(3, 200, size=(3, SEQ)).astype(np.int32)
  rows[0, 40:] = eos  # padded; an EOS inside a row; no padding at all
  rows[1, 10], rows[1, 70:] = eos, eos
  ours = np.asarray(reward_model.score_program(loaded.model_config, eos)(loaded.params, rows))
  model = transformers.AutoModelForSequenceClassification.from_pretrained(
    hf_dir, dtype=torch.float32
  )
  assert model.config.num_labels == 1
  with torch.no_grad():
    theirs = model(torch.tensor(rows, dtype=torch.long)).logits[:, 0].numpy()
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-5)


def test_a_layout_without_a_classification_class_is_refused_in_one_line():
  llada_like = tiny_test_config(**{'stage': 'reward', 'init_from': 'x', 'model.qk_norm': False})
  cfg = model_lib.ModelConfig.from_config(llada_like)
  with pytest.raises(
    hf_config.HFConfigError, match='llada layout has no sequence-classification .*--layout=llama'
  ):
    hf_layouts.choose('llada', cfg)
  block = model_lib.ModelConfig.from_config(
    tiny_test_config(
      **{'stage': 'reward', 'init_from': 'x', 'model.attention_mask': 'block_causal'}
    )
  )
  with pytest.raises(hf_config.HFConfigError, match='not by block; no layout can hold it'):
    hf_layouts.choose('qwen3', block)


@pytest.fixture(scope='module')
def lora_reward_run(reward_run, tmp_path_factory):
  """(config, run dir) of one LoRA reward step over reward_run's language model."""
  config, _ = reward_run
  c = config.copy_and_resolve_references()
  c.output_dir = str(tmp_path_factory.mktemp('lora_reward'))
  c.train.steps, c.eval.every = 1, 0
  c.train.lora.rank, c.train.lora.alpha, c.train.lora.base_dtype = 4, 8.0, 'float32'
  c.train.lora.targets = 'q,v,up'
  loop.train(c)
  return c, c.output_dir


def test_lora_trains_the_score_head_whole_beside_the_adapters(lora_reward_run):
  c, out = lora_reward_run
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(out)
  _, adapters, frozen = run_model.restore_lora(run_dir, step_dir, c)
  assert 'score' in adapters and 'score' not in frozen  # trained, saved with the adapters
  fresh = np.asarray(score_head.fresh(c.seed, c.model.d_model, c.model.init_std))
  assert np.abs(fresh).max() > 0  # a drawn head (not zero as B is), and the step moved it
  assert np.abs(np.asarray(adapters['score']) - fresh).max() > 0
  b = jax.device_get(adapters['blocks']['attn']['q_proj' + lora.B_SUFFIX])
  assert np.abs(b).max() > 0  # the adapters trained beside it


def test_a_lora_reward_runs_peft_export_holds_the_score_head(lora_reward_run, tmp_path):
  """PEFT's sequence-classification layout: the head in modules_to_save; PEFT over the exported
  base scores as the run does, and the base alone is the run at step 0 (B = 0, the fresh head)."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  peft = pytest.importorskip('peft')
  c, out = lora_reward_run
  peft_dir = str(tmp_path / 'peft')
  assert convert.main(['to-hf', '--checkpoint-path', out, '--output-dir', peft_dir,
                       '--dtype', 'fp32', '--adapter', 'peft']) == 0  # fmt: skip
  with open(os.path.join(peft_dir, peft_io.CONFIG_FILE)) as f:
    adapter_config = json.load(f)
  assert adapter_config['task_type'] == 'SEQ_CLS' and adapter_config['modules_to_save'] == ['score']
  eos = c.model.eos_token_id
  rows = np.random.default_rng(0).integers(3, 200, size=(2, SEQ)).astype(np.int32)
  rows[0, 50:] = eos
  loaded = run_model.restore(out)  # merged: the adapters and the trained head
  ours = np.asarray(reward_model.score_program(loaded.model_config, eos)(loaded.params, rows))
  base_dir = os.path.join(peft_dir, 'base')
  run_dir, step_dir, _ = run_dir_lib.resolve_step_dir(out)
  _, _, frozen = run_model.restore_lora(run_dir, step_dir, c)
  start = score_head.attach(jax.device_get(frozen), loaded.model_config, c.seed)
  at_start = np.asarray(reward_model.score_program(loaded.model_config, eos)(start, rows))
  assert np.abs(ours - at_start).max() > 1e-3  # the step moved the scores
  load = transformers.AutoModelForSequenceClassification.from_pretrained
  with torch.no_grad():
    base = load(base_dir, dtype=torch.float32).eval()
    np.testing.assert_allclose(
      base(torch.tensor(rows, dtype=torch.long)).logits[:, 0].numpy(),
      at_start,
      rtol=1e-4,
      atol=1e-5,
    )
    model = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    theirs = model(torch.tensor(rows, dtype=torch.long)).logits[:, 0].numpy()
  np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-5)
  # And back in as train.lora.init_adapter: the same adapters, the trained head among them.
  again = c.copy_and_resolve_references()
  again.train.lora.init_adapter = peft_dir
  setup = state_lib.TrainSetup(again, mesh_lib.make_mesh(again))
  back = jax.device_get(peft_io.read_adapter(peft_dir, again, setup))
  _, adapters, _ = run_model.restore_lora(run_dir, step_dir, c)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-7), back, jax.device_get(adapters)
  )


def test_verify_checks_a_reward_runs_integrity_and_names_the_parity_it_skips(reward_run):
  checks = verify.verify(reward_run[1])
  assert all(c.ok for c in checks), verify.report(checks)
  assert checks[-1].name == 'logits parity' and 'a reward model has a score' in checks[-1].detail


def test_a_reward_run_refuses_to_generate_and_to_start_a_language_model(reward_run, capsys):
  """No token head: generate, infill, logits and the CLI say so in one line; and a language-model
  stage cannot start from it."""
  _, out = reward_run
  model = inference.load_pretrained(out)
  for use in (lambda: model.generate('1+1'), lambda: model.infill('a <mask:2> b')):
    with pytest.raises(ValueError, match='is a reward model .*no token head.*rl.reward_model'):
      use()
  with pytest.raises(ValueError, match='no token logits'):
    model.logits(np.zeros((1, 4), np.int32))
  assert generate.main(['--checkpoint-path', out, '--prompt', '1+1']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and 'is a reward model (a score head, no token head)' in err
  sft = tiny_test_config(**{'stage': 'sft', 'init_from': out, 'model.seq_len': SEQ})
  with pytest.raises(
    run_dir_lib.CheckpointError, match='is a reward model .*stage=sft run cannot start from it'
  ):
    run_model.source_params(sft)


def _transformers_reward_model(path, **overrides):
  """A Qwen3ForSequenceClassification made by transformers alone (no dlmjax files, causal as
  transformers' class is), the tiny model's shape, saved to `path`."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  m = tiny_test_config().model
  fields = dict(
    vocab_size=m.vocab_size,
    hidden_size=m.d_model,
    intermediate_size=m.ffn_dim,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    num_key_value_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    rms_norm_eps=m.norm_eps,
    rope_theta=m.rope_theta,
    max_position_embeddings=SEQ,
    tie_word_embeddings=False,
    eos_token_id=m.eos_token_id,
    pad_token_id=m.eos_token_id,
    num_labels=1,
  )
  hf = transformers.Qwen3Config(**{**fields, **overrides})
  torch.manual_seed(0)
  model = transformers.Qwen3ForSequenceClassification(hf).eval()
  with torch.no_grad():  # a head far from zero, so the scores differ row by row
    model.score.weight.normal_(0.0, 1.0)
  model.save_pretrained(path)
  return model


def test_a_transformers_sequence_classification_model_imports_as_a_reward_model(tmp_path):
  """Read as ours (causal, its head): the same scores as transformers; init_from keeps its head;
  rl.reward_model can point at the directory. Where it cannot score the same, one line."""
  torch = pytest.importorskip('torch')
  hf_dir = str(tmp_path / 'rm')
  model = _transformers_reward_model(hf_dir)
  eos = tiny_test_config().model.eos_token_id
  rows = np.random.default_rng(0).integers(3, 200, size=(3, SEQ)).astype(np.int32)
  rows[0, 40:], rows[1, 10], rows[1, 70:] = eos, eos, eos
  with torch.no_grad():
    theirs = model(torch.tensor(rows, dtype=torch.long)).logits[:, 0].numpy()
  config, params = hf_io.load_hf(hf_dir)
  assert config.stage == 'reward' and config.model.attention_mask == 'causal'
  cfg = model_lib.ModelConfig.from_config(config)
  ours = np.asarray(reward_model.score_program(cfg, eos)(params, rows))
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
  # init_from for the reward stage keeps the head (a language model gets a fresh one).
  reward = tiny_test_config(**{'stage': 'reward', 'init_from': hf_dir, 'model.seq_len': SEQ})
  reward.model.attention_mask = 'causal'
  start = run_model.source_params(reward)
  np.testing.assert_array_equal(np.asarray(start['score']), np.asarray(params['score']))
  # RL against it: rl.reward_model names the directory.
  rl = tiny_test_config(**{'stage': 'rl', 'rl.reward_model': hf_dir, 'init_from': 'x'})
  scorer = reward_model.RewardModel(hf_dir, policy=rl)
  np.testing.assert_allclose(scorer(rows, batch_size=2), theirs, rtol=1e-4, atol=1e-5)
  # Refused in one line: a language-model stage; two labels; pooling at a pad other than EOS.
  sft = tiny_test_config(**{'stage': 'sft', 'init_from': hf_dir, 'model.seq_len': SEQ})
  sft.model.attention_mask = 'causal'
  with pytest.raises(hf_config.HFConfigError, match='stage=sft run cannot start from it'):
    run_model.source_params(sft)
  _transformers_reward_model(str(tmp_path / 'two'), num_labels=2)
  with pytest.raises(hf_config.HFConfigError, match='with 2 labels; a reward model has one'):
    hf_io.load_hf(str(tmp_path / 'two'))
  _transformers_reward_model(str(tmp_path / 'pad'), **{'pad_token_id': 0})
  with pytest.raises(hf_config.HFConfigError, match='not pad_token_id=0, dlmjax at the last'):
    reward_model.RewardModel(str(tmp_path / 'pad'), policy=rl)
