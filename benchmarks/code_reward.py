"""Executed-code rewards: sandbox seconds per completion, and one RL iteration with the reward.

  python -m benchmarks.code_reward --programs 64 --workers 8          # sandbox only (CPU)
  python -m benchmarks.code_reward --programs 64 --workers 8 --rl     # + a tiny-model RL step
  python -m benchmarks.code_reward --programs 64 --workers 16 --allow-unsandboxed-code  # no bwrap

Sandbox: --programs MBPP-format problems (add_k: return x + k, three tests each), each scored
with a correct, a half-wrong, a broken and (every 8th) a hostile completion (endless loop or a
socket); the rewards are checked against what each must get (1, 1/3, 0, 0) before any time is
printed. Reported: the sandbox's seconds per completion (mean, p50, p90), the batch's wall
seconds and completions per second at --workers parallel sandboxes, and what held them (the
sandbox line: the OS boundary, or none with --allow-unsandboxed-code).
--rl: a random tiny model (configs/tiny.py shrunk) saved as a checkpoint, then two RL rollouts
(rl.task=mbpp on those problems, rl.inner_updates updates each) through the normal trainer; of
the second (compiled) rollout: generate_s, score_s, and inside score_s the sandboxes' reward_s
and the log-probs' logprob_s, which run at once (score_s about their max, not their sum), and
the update's step_time_s (metrics.jsonl). Then overlap: the same model generates batches of
completions alone (G, repeated to take about S), the sandboxes score a batch alone (S), and both
at once (C, Scorer.submit before generating): overlap = (G + S - C) / min(G, S), 1 = the
sandboxes cost the accelerator nothing, 0 = they run one after the other: what scoring rollout k
while generating rollout k+1 would buy beyond the overlap with the log-probs. One table last.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from dlmjax import tasks
from dlmjax.tasks import code_exec

HOSTILE = ('while True:\n  pass\n', 'import socket\nsocket.socket().connect(("1.1.1.1", 80))\n')


def problem_rows(num: int) -> list[dict]:
  return [
    dict(
      task_id=k,
      text=f'Write add_{k}(x) that returns x plus {k}.',
      code=f'def add_{k}(x):\n  return x + {k}',
      test_list=[f'assert add_{k}({x}) == {x + k}' for x in (0, 1, 2)],
    )
    for k in range(1, num + 1)
  ]


def completions_of(k: int) -> list[tuple[str, float]]:
  """(completion, the reward it must get) for problem k."""
  out = [
    (f'```python\ndef add_{k}(x):\n  return x + {k}\n```', 1.0),
    (f'```python\ndef add_{k}(x):\n  return {k} if x == 0 else 0\n```', 1 / 3),
    ('```python\ndef broken(:\n```', 0.0),
  ]
  if k % 8 == 0:
    out.append((f'```python\n{HOSTILE[(k // 8) % 2]}```', 0.0))
  return out


def sandbox_bench(rows, workers: int, limits: code_exec.Limits, unsandboxed=False) -> dict:
  task = tasks.Mbpp('')
  examples, completions, expected = [], [], []
  for row in rows:
    example = task.example_of(row)
    for completion, reward in completions_of(int(row['task_id'])):
      examples.append(example)
      completions.append(completion)
      expected.append(reward)
  scorer = code_exec.Scorer(limits, workers, allow_unsandboxed=unsandboxed)
  start = time.perf_counter()
  outcomes = scorer.run([tasks.code.program_of(e, c) for e, c in zip(examples, completions)])
  wall = time.perf_counter() - start
  scorer.close()
  rewards = [o.reward for o in outcomes]
  wrong = [i for i, (r, want) in enumerate(zip(rewards, expected)) if abs(r - want) > 1e-9]
  if wrong:
    i = wrong[0]
    raise SystemExit(
      f'wrong reward for completion {i}: {rewards[i]} != {expected[i]} '
      f'({outcomes[i].status}: {outcomes[i].detail[-200:]})'
    )
  seconds = np.array([o.seconds for o in outcomes])
  return dict(
    completions=len(outcomes),
    workers=workers,
    sandbox_mean_s=float(seconds.mean()),
    sandbox_p50_s=float(np.percentile(seconds, 50)),
    sandbox_p90_s=float(np.percentile(seconds, 90)),
    batch_wall_s=wall,
    per_second=len(outcomes) / wall,
    counts={k: v for k, v in scorer.counts.items() if v},
    sandbox=code_exec.boundary()[1],
  )


def tiny_config(output_dir: str, **overrides):
  from dlmjax import config as config_lib  # pylint: disable=import-outside-toplevel

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = config_lib.load_file(os.path.join(root, 'configs', 'tiny.py'))
  base = {
    'model.num_layers': 2,
    'model.d_model': 64,
    'model.num_heads': 4,
    'model.num_kv_heads': 2,
    'model.head_dim': 16,
    'model.ffn_dim': 128,
    'model.seq_len': 256,
    'output_dir': output_dir,
    'log.outputs': '',
  }
  return config_lib.apply_overrides(c, {**base, **overrides})


def rl_bench(rows, workdir: str, args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  from dlmjax.checkpoint import params_checkpoint  # pylint: disable=import-outside-toplevel
  from dlmjax.parallel import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from dlmjax.train import loop  # pylint: disable=import-outside-toplevel
  from dlmjax.train import state as state_lib  # pylint: disable=import-outside-toplevel

  data = os.path.join(workdir, 'mbpp.jsonl')
  with open(data, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  init = os.path.join(workdir, 'init')
  c = tiny_config(init)
  setup = state_lib.TrainSetup(c, mesh_lib.make_mesh(c))
  params_checkpoint.save_params_checkpoint(init, c, jax.device_get(setup.init_state(0)['params']))
  rl = tiny_config(
    os.path.join(workdir, 'rl'),
    **{
      'stage': 'rl',
      'init_from': init,
      'rl.task': 'mbpp',
      'rl.allow_unsandboxed_code': args.allow_unsandboxed_code,
      'rl.task_data': data,
      'rl.num_prompts': len(rows),
      'rl.max_prompt_tokens': 192,
      'rl.group_size': 4,
      'rl.inner_updates': 2,
      'train.global_batch_size': args.rl_batch,
      'train.micro_batch_size': args.rl_batch,
      'train.steps': 4,  # two rollouts: the second is compiled
      'train.schedule': 'constant',
      'train.warmup_steps': 0,
      'sampler.gen_length': 64,
      'sampler.steps': 16,
      'sampler.block_length': 64,
      'checkpoint.every': 0,
    },
  )
  loop.train(rl)
  with open(os.path.join(rl.output_dir, 'metrics.jsonl')) as f:
    metrics = [json.loads(line) for line in f]
  rollout = [r for r in metrics if 'generate_s' in r][-1]
  updates = [r['step_time_s'] for r in metrics if 'step_time_s' in r]
  return dict(
    rl_generate_s=rollout['generate_s'],
    rl_score_s=rollout['score_s'],
    rl_reward_s=rollout['reward_s'],
    rl_logprob_s=rollout['logprob_s'],
    rl_update_s=float(np.mean(updates)) if updates else float('nan'),
    rl_reward=rollout['rollout_reward_mean'],
    **overlap(init, rows, args),
  )


def overlap(init: str, rows, args) -> dict:
  from dlmjax import evaluate  # pylint: disable=import-outside-toplevel
  from dlmjax.diffusion import sampling_config  # pylint: disable=import-outside-toplevel

  sampling = sampling_config.SamplingConfig(gen_length=64, steps=16, block_length=64)
  model = evaluate.EvalModel(init, sampling=sampling, batch_size=args.rl_batch)
  task = tasks.Mbpp('')
  prompts = [task.example_of(r).prompt[:160] for r in rows][: args.rl_batch]
  model.generate(prompts)  # compile
  programs = [
    tasks.code.program_of(task.example_of(r), c)
    for r in rows
    for c, _ in completions_of(int(r['task_id']))
  ]
  scorer = code_exec.Scorer(
    code_exec.Limits(), args.workers, allow_unsandboxed=args.allow_unsandboxed_code
  )
  start = time.perf_counter()
  scorer.run(programs)
  score = time.perf_counter() - start
  # A tiny model generates in milliseconds: G repeats its batch to take about S, so the overlap
  # compares like with like.
  start = time.perf_counter()
  model.generate(prompts)
  repeats = max(1, round(score / (time.perf_counter() - start)))

  def generate_all():
    for _ in range(repeats):
      model.generate(prompts)

  start = time.perf_counter()
  generate_all()
  generate = time.perf_counter() - start
  start = time.perf_counter()
  future = scorer.submit(programs)
  generate_all()
  future.result()
  both = time.perf_counter() - start
  scorer.close()
  return dict(
    generate_batches=repeats,
    alone_generate_s=generate,
    alone_score_s=score,
    together_s=both,
    overlap=(generate + score - both) / max(1e-9, min(generate, score)),
  )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--programs', type=int, default=64, help='problems (3-4 completions each)')
  parser.add_argument('--workers', type=int, default=0, help='parallel sandboxes (0: CPUs)')
  parser.add_argument('--wall-s', type=float, default=3.0, help='sandbox wall-clock limit')
  parser.add_argument('--rl', action='store_true', help='also one tiny-model RL iteration')
  parser.add_argument('--rl-batch', type=int, default=16, help='RL rollout rows')
  parser.add_argument(
    '--allow-unsandboxed-code',
    action='store_true',
    help='where the machine has no OS boundary: measure the audit hook and rlimits alone',
  )
  args = parser.parse_args(argv)
  args.workers = args.workers or max(2, os.cpu_count() or 2)
  rows = problem_rows(args.programs)
  limits = code_exec.Limits(wall_s=args.wall_s, cpu_s=max(1, int(args.wall_s)))
  result = sandbox_bench(rows, args.workers, limits, args.allow_unsandboxed_code)
  if args.rl:
    with tempfile.TemporaryDirectory() as workdir:
      result.update(rl_bench(rows, workdir, args))
  print('RESULT ' + json.dumps(result))
  print('\n| metric | value |\n| --- | --- |')
  for key, value in result.items():
    print(f'| {key} | {value:.3f} |' if isinstance(value, float) else f'| {key} | {value} |')


if __name__ == '__main__':
  main()
