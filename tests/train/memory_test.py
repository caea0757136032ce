"""The fail-fast memory estimate: a hand-written formula, the H200 measurements it is calibrated
on (docs/benchmarks.md, Memory per device), and the refusal in summary and train."""

import os
import subprocess
import sys

import pytest

from dlmjax import config as config_lib
from dlmjax.train import memory

ROOT = os.path.join(os.path.dirname(__file__), '..', '..')
GIB = 1024**3


def _config_1p7b(devices=1, **overrides):
  c = config_lib.load_file(os.path.join(ROOT, 'configs', 'pretrain_1p7b.py'))
  config_lib.apply_overrides(c, overrides)
  config_lib.fit_to_devices(c, devices)
  return c


def _8b(devices, mb, **mesh):
  return _config_1p7b(
    devices,
    **{
      'model.num_layers': 36,
      'model.d_model': 4096,
      'model.num_heads': 32,
      'model.num_kv_heads': 8,
      'model.ffn_dim': 12288,
      'model.vocab_size': 151936,
      'train.micro_batch_size': mb,
      'train.global_batch_size': mb,
      'model.remat': 'save_dots',
      **{f'mesh.{k}': v for k, v in mesh.items()},
    },
  )


def test_matches_the_formula_written_out():
  c = _config_1p7b(
    1, **{'train.micro_batch_size': 8, 'train.global_batch_size': 8, 'model.remat': 'save_dots'}
  )
  got = memory.estimate_bytes_per_device(c)
  params = 1_732_895_744
  tokens, layers, d, f = 8 * 2048, 28, 2048, 6144
  assert got['state'] == 16 * params
  # save_dots: layer input, q, k, v (16 heads x 128 each), out proj, gate, up, down; bf16.
  assert got['activations'] == tokens * layers * 2 * (d + 2048 + 2 * 2048 + d + 2 * f + d)
  # One layer of what save_dots did not keep: everything ('none') less the above.
  assert got['recompute'] == tokens * 2 * (
    (10 * d + 3 * 2048 + 4 * 2048 + 6 * f) - (d + 2048 + 2 * 2048 + d + 2 * f + d)
  )
  # + both norms, q and k after RoPE, the mid-layer stream, the SwiGLU product
  c.model.remat = 'save_activations'
  assert memory.estimate_bytes_per_device(c)['activations'] == (
    tokens * layers * 2 * (6 * d + 3 * 2048 + 3 * 2048 + 3 * f)
  )
  assert got['logits'] == 2 * 4096 * 50304 * 4  # one fused chunk, fp32 logits and gradient
  assert got['total'] == pytest.approx(
    sum(got[k] for k in ('state', 'activations', 'recompute', 'logits'))
  )
  # Accumulating over micro-batches keeps an fp32 gradient sum: 4 more bytes per parameter.
  accumulating = _config_1p7b(1, **{'train.micro_batch_size': 8, 'train.global_batch_size': 32})
  assert memory.estimate_bytes_per_device(accumulating)['state'] == 20 * params


def _save_dots(devices, **overrides):
  return _config_1p7b(devices, **{'model.remat': 'save_dots', **overrides})


def _mb(mb, **overrides):
  return {'train.micro_batch_size': mb, 'train.global_batch_size': mb, **overrides}


def test_rl_counts_its_kl_reference():
  """RL with a KL term keeps a copy of the params on the devices (in rl.reference_dtype); none
  without a KL term, in host memory, or with LoRA (the reference is the frozen base)."""
  c = _config_1p7b(1)
  base = memory.estimate_bytes_per_device(c)['state']
  c.stage = 'rl'
  c.rl.objective, c.rl.kl_beta, c.rl.reference_dtype = 'd1', 0.04, 'bfloat16'
  assert memory.estimate_bytes_per_device(c)['state'] == base + 2 * 1_732_895_744
  c.rl.reference_on_host = True
  assert memory.estimate_bytes_per_device(c)['state'] == base
  c.rl.reference_on_host, c.rl.kl_beta = False, 0.0
  assert memory.estimate_bytes_per_device(c)['state'] == base


@pytest.mark.parametrize(
  'config,measured_gib',
  [
    # With the current layer loop (weights cast once, split per layer).
    (lambda: _save_dots(1, **_mb(8)), 43.8),
    (lambda: _config_1p7b(1, **_mb(8, **{'model.remat': 'save_dots_attention'})), 45.6),
    (lambda: _config_1p7b(1, **_mb(8, **{'model.remat': 'save_activations'})), 58.0),
    (lambda: _config_1p7b(1, **_mb(16, **{'model.remat': 'save_activations'})), 91.5),
    # Before that loop (it kept each layer's float32 weights for the backward).
    (lambda: _save_dots(1, **_mb(16)), 66.0),
    (lambda: _save_dots(2, **_mb(16)), 34.5),
    (
      lambda: _save_dots(
        2,
        **{
          'train.micro_batch_size': 16,
          'train.global_batch_size': 64,
          'mesh.data': 2,
          'mesh.fsdp': 1,
        },
      ),
      52.2,
    ),
    (lambda: _save_dots(2, **_mb(8, **{'mesh.tensor': 2, 'mesh.fsdp': 1})), 24.8),
    (lambda: _8b(4, 16), 57.0),
    (lambda: _8b(4, 32), 79.1),
  ],
)
def test_calibrated_on_h200_runs(config, measured_gib):
  """Peak GiB per GPU measured on H200s (docs/benchmarks.md, Memory per device): never under,
  at most 15% over."""
  estimate = memory.estimate_bytes_per_device(config())['total'] / GIB
  assert measured_gib * 0.97 <= estimate <= measured_gib * 1.15


def test_device_memory_table(monkeypatch):
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.9')
  assert memory.device_memory_bytes('NVIDIA H200') == pytest.approx(140.4 * GIB * 0.9)
  assert memory.device_memory_bytes('NVIDIA GH200 480GB') == pytest.approx(95.6 * GIB * 0.9)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION')
  assert memory.device_memory_bytes('NVIDIA H100 80GB HBM3') == pytest.approx(79.6 * GIB * 0.75)
  assert memory.device_memory_bytes('cpu') is None


def test_check_names_the_knob():
  c = _config_1p7b(1, **{'train.micro_batch_size': 64, 'train.global_batch_size': 64})
  assert memory.check_fits(c, None)['total'] > 100 * GIB  # no capacity known: no check
  with pytest.raises(
    config_lib.ConfigError, match='remat=save_dots_attention or --config.model.remat=full'
  ):
    memory.check_fits(c, 80 * GIB)  # the default save_activations: the middle step first
  c.model.remat = 'save_dots'
  with pytest.raises(config_lib.ConfigError, match=r'remat=full \(now save_dots\)'):
    memory.check_fits(c, 80 * GIB)
  big = _8b(1, 1, fsdp=1)  # the state alone (131 GB) exceeds an H100
  with pytest.raises(config_lib.ConfigError, match='raise mesh.fsdp'):
    memory.check_fits(big, 80 * GIB)


def test_train_refuses_before_compiling(tmp_path, monkeypatch):
  from dlmjax.train import loop  # pylint: disable=import-outside-toplevel
  from tests.conftest import tiny_test_config  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(memory, 'present_device_memory_bytes', lambda: 1024.0)
  c = tiny_test_config()
  c.output_dir = str(tmp_path)
  with pytest.raises(config_lib.ConfigError, match='GiB per device'):
    loop.train(c)
  assert not os.path.exists(tmp_path / 'checkpoints' / '1')


def test_summary_fails_fast_with_exit_2():
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='')
  args = [
    sys.executable,
    '-m',
    'dlmjax.summary',
    '--config=configs/pretrain_1p7b.py',
    '--devices=8',
    '--device-kind=H100',
    '--config.train.micro_batch_size=256',
    '--config.train.global_batch_size=256',
  ]
  result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert 'GiB per device' in result.stderr and 'micro_batch_size' in result.stderr
  result = subprocess.run(args[:-2], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  assert 'memory check: fits' in result.stdout


def test_lora_base_splits_routed_experts_over_the_expert_axis():
  """A LoRA run's frozen base is sharded as the full model's params are: the routed experts over
  mesh.expert (LLaDA2.0-mini: 19 MoE layers x 256 experts x 3 x 2048 x 512, bf16)."""

  def state(expert):
    c = config_lib.load_file(os.path.join(ROOT, 'configs', 'sft.py') + ':llada2_mini')
    config_lib.apply_overrides(
      c,
      {
        'init_from': 'random-weights',
        'model.dtype': 'bfloat16',
        'train.lora.rank': 64,
        'train.lora.base_dtype': 'bfloat16',
        'train.micro_batch_size': 8,
        'train.global_batch_size': 8,
        'mesh.fsdp': 8 // expert,
        'mesh.expert': expert,
      },
    )
    config_lib.fit_to_devices(c, 8)
    return memory.estimate_bytes_per_device(c)['state'] * (8 // expert)  # undo the fsdp split

  routed = 19 * 256 * 3 * 2048 * 512
  assert state(1) - state(8) == pytest.approx(2 * routed * 7 / 8)
