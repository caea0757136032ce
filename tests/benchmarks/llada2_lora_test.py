"""python -m benchmarks.llada2_lora on CPU: the dlmjax side of the LoRA SFT table (no peer code
here, and the table says so), the decode table, and the pieces the GPU numbers rest on: the
peer's block-diffusion mask and the count of forwards a threshold decode ran."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import llada2_lora
from dlmjax.kernels import flash_attention


def _json_rows(out):
  return [json.loads(line) for line in out.splitlines() if line.startswith('{')]


@pytest.mark.slow  # a subprocess compiling the two-stream MoE LoRA step: ~20 s on 2 loaded cores
def test_tiny_sft_runs_dlmjax_alone_and_says_the_peer_did_not_run(capsys):
  assert llada2_lora.main(['--tiny', '--steps', '1', '--warmup', '0', '--micro-batch', '8']) == 0
  out = capsys.readouterr().out
  (row,) = _json_rows(out)
  assert row['side'] == 'dlmjax (JAX)' and row['tokens_per_s'] > 0 and np.isfinite(row['loss'])
  assert 'peer not run: give --peer-code DIR' in out


def test_a_folder_without_the_family_code_is_refused_in_one_line(tmp_path):
  with pytest.raises(SystemExit, match='no modeling_llada2_moe.py'):
    llada2_lora.main(['--tiny', '--peer-code', str(tmp_path)])
  with pytest.raises(SystemExit, match='--only peer needs --peer-code'):
    llada2_lora.main(['--tiny', '--only', 'peer'])


def test_tiny_decode_reports_forwards_bound_and_block_routing(capsys):
  assert llada2_lora.main(['--tiny', '--decode']) == 0
  rows = _json_rows(capsys.readouterr().out)
  decodes = [r for r in rows if 'batch' in r]
  assert [(r['batch'], r['block_experts']) for r in decodes] == [(1, 0), (2, 0), (1, 4)]
  # 16 tokens in blocks of 8 at 8 steps a block: random weights pass no 0.95 threshold, so one
  # token commits per forward, 16 forwards.
  assert all(r['forwards'] == 16 and r['tokens_per_s'] > 0 for r in decodes)
  token, block = [r for r in rows if 'experts_touched' in r]
  assert (token['block_experts'], block['block_experts']) == (0, 4)
  assert block['experts_touched'] <= 4 < token['experts_weighted'] <= token['experts_touched']
  assert block['experts_weighted'] <= block['experts_touched']


def test_peer_mask_is_bd3lm_two_stream_mask():
  """dFactory's block_diffusion_mask as the peer builds it equals dlmjax's training mask."""
  length, block = 12, 4
  got = llada2_lora.block_diffusion_mask(length, block).numpy()
  index = jnp.arange(2 * length)
  want = flash_attention.two_stream_visible(
    index[:, None], index[None, :], half=length, block_size=block
  )
  np.testing.assert_array_equal(got, np.asarray(want))


def test_forwards_run_counts_the_slowest_row_of_each_block():
  # steps_per_block 4: block 0 took 3 forwards (row 1's step 2), block 1 took 4, block 2 one.
  steps = np.array([[0, 1, 4, 5, 8, -1], [2, 0, 7, 4, -1, -1]])
  assert llada2_lora.forwards_run(steps, 4) == 3 + 4 + 1
