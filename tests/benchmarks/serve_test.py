"""python -m benchmarks.serve: its loopback load test runs its bounded requests and stops."""

import functools
import json

import jax

from benchmarks import serve
from dlmjax import model as model_lib
from tests.checkpoint import tiny_run


def test_load_test_runs_bounded_requests_on_loopback(tmp_path, capsys):
  tiny_run.make_run(tmp_path / 'run')  # no tokenizer: prompts are token ids
  args = ['--checkpoint-path', str(tmp_path / 'run'), '--clients', '1', '--prompt-lengths', '4']
  args += ['--gen-lengths', '16', '--block-length', '8', '--requests-per-client', '2']
  assert serve.main(args) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert lines[0]['compiled'] == 1  # one bucket, compiled before timing
  row = lines[1]
  assert row['clients'] == 1 and row['requests'] == 2 and row['errors'] == 0
  assert row['generated_tok_s'] > 0 and row['calls'] == 4 and row['http_overhead'] is not None
  # Nothing compiles while timed, the second block's call (carried from the first) included.
  assert row['compiled_while_timed'] == 0 and row['dispatch_blocking'] is not None
  # The ceiling: one client's level is its own baseline (the batch-1 call timed once, reused).
  assert row['ceiling_x'] == 1 and row['block_call_s'] == row['block_call_1_s'] > 0
  assert row['ceiling_canvas'] == 'batch 1 x length 64' and row['ceiling_compiled'] == 0


def test_several_clients_compile_nothing_after_warm_up(tmp_path, capsys):
  """Mixed prompts and max_tokens from 4 clients: calls of every batch bucket follow each other,
  a continuing row's blocks carried from a call of another batch size; warm-up compiled all."""
  tiny_run.make_run(tmp_path / 'run', **{'model.seq_len': 128})
  args = ['--checkpoint-path', str(tmp_path / 'run'), '--clients', '4', '--cache', 'dual']
  args += ['--prompt-lengths', '4,12', '--gen-lengths', '8,40', '--block-length', '8']
  assert serve.main(args + ['--requests-per-client', '2']) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  row = lines[1]
  # (Whether the 4 clients' requests share calls is up to the threads' timing: not asserted.)
  assert row['requests'] == 8 and row['errors'] == 0
  assert row['compiled_while_timed'] == 0, row
  # The ceiling timed warm-up's batch-4 program (nothing compiled) on its own. Its figures are
  # timings (compared on a GPU, not in a test): here only that both calls ran.
  assert row['ceiling_compiled'] == 0 and row['ceiling_canvas'].startswith('batch 4 x '), row
  assert row['block_call_s'] > 0 and row['block_call_1_s'] > 0, row
  ceiling = 4 * row['block_call_1_s'] / row['block_call_s']  # rows x t_1 / t_B
  assert abs(row['ceiling_x'] - ceiling) <= 0.01 * ceiling + 0.01, row


def test_a_stored_system_prompts_programs_are_warmed_too(tmp_path, capsys):
  """Rows after a stored system prompt (a block-causal model, the block cache) run programs of
  their own: warm-up compiles them, the prompt stored first, so nothing compiles while timed;
  and only them, since every request starts with it (no row runs the prefix-less programs)."""
  overrides = {'model.seq_len': 64, 'model.attention_mask': 'block_causal', 'model.block_size': 4}
  tiny_run.make_run(tmp_path / 'run', **overrides)
  args = ['--checkpoint-path', str(tmp_path / 'run'), '--clients', '2', '--cache', 'block']
  args += ['--prompt-lengths', '4,12', '--gen-lengths', '8,16', '--block-length', '8']
  assert serve.main(args + ['--system-prompt', '16', '--requests-per-client', '2']) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert lines[0]['compiled'] == 2  # batch 1 and 2, canvas 64, after the prefix only
  row = lines[1]
  assert row['requests'] == 4 and row['errors'] == 0 and row['prefix_rows'] > 0
  assert row['compiled_while_timed'] == 0, row
  assert row['ceiling_compiled'] == 0, row  # its rows start with the stored prompt, as warmed


def test_the_8b_runs_random_weights_of_the_llada_8b_shape(capsys):
  """--preset llada_8b over the 1.7B config (the GPU table's 8B run) builds LLaDA-8B's shape:
  its parameter count by hand from the preset's dims, traced only (no weights on the CPU); the
  same path initialises a small preset's weights here; a preset over a checkpoint is refused."""
  flags = ['--config', 'configs/pretrain_1p7b.py', '--preset', 'llada_8b', '--dtype', 'bf16']
  config = serve.random_config(serve._parser().parse_args(flags))
  shapes = jax.eval_shape(
    functools.partial(model_lib.init_params, model_lib.ModelConfig.from_config(config)),
    jax.random.key(0),
  )
  layers, d, ffn, vocab = 32, 4096, 12288, 126464  # LLaDA-8B: MHA 32 x 128, untied, no QK-norm
  expected = layers * (4 * d * d + 3 * d * ffn + 2 * d) + 2 * vocab * d + d
  assert sum(x.size for x in jax.tree.leaves(shapes)) == expected == 8_015_581_184
  m = config.model
  assert (m.attention_mask, m.dtype, m.seq_len, m.mask_token_id) == (
    'bidirectional',
    'bfloat16',
    4096,
    126336,
  )
  small = ['--config', 'configs/pretrain_1p7b.py:smoke', '--preset', 'tiny', '--dtype', 'fp32']
  model = serve._load(serve._parser().parse_args(small))
  assert model.config.model.num_layers == 4 and model.config.model.dtype == 'float32'
  assert serve.main(['--checkpoint-path', 'run', '--preset', 'llada_8b']) == 2
  assert '--preset shapes random weights' in capsys.readouterr().err
