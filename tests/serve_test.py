"""python -m dlmjax.serve through real HTTP with the official openai client: a tiny bidirectional
run served on 127.0.0.1 (an ephemeral port) in a subprocess, one server for the whole module; the
engine alone for a block-causal run."""

import contextlib
import dataclasses
import io
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import openai
import pytest

import dlmjax

from dlmjax import generate
from dlmjax.diffusion import sampling_config
from dlmjax.serve import engine
from tests.checkpoint import tiny_run

# 4 blocks a request: the server decodes block by block (the block-causal run: its block size).
SETTINGS = dict(gen_length=16, steps=8, block_length=4)
FLAGS = ['--gen-length', '16', '--steps', '8', '--block-length', '4']
PROMPTS = [' '.join(f't{5 + 7 * i + j}' for j in range(1 + i % 6)) for i in range(16)]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _make_run(root, attention='bidirectional', **overrides) -> str:
  import tokenizers  # pylint: disable=import-outside-toplevel

  tokenizer = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({f't{i}': i for i in range(256)}, unk_token='t1')
  )
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(root / 'tokenizer.json'))
  overrides = {
    'data.tokenizer': str(root / 'tokenizer.json'),
    'model.attention_mask': attention,
    'model.block_size': 4,
    **overrides,
  }
  tiny_run.make_run(root / 'run', **overrides)
  return str(root / 'run')


@pytest.fixture(scope='module')
def served(tmp_path_factory):
  """(run directory, base url, the server process, its first response: sent while compiling)."""
  run = _make_run(tmp_path_factory.mktemp('serve'))
  port = _free_port()
  command = [sys.executable, '-m', 'dlmjax.serve', '--checkpoint-path', run, '--port', str(port)]
  command += FLAGS + ['--max-batch', '16', '--max-queue', '24', '--batch-buckets', '16']
  command += ['--width-buckets', '32,64', '--blocks-per-call', '4']
  log = open(str(tmp_path_factory.getbasetemp() / 'serve.log'), 'w+')  # pylint: disable=consider-using-with
  proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
  url = f'http://127.0.0.1:{port}'
  first = None
  for _ in range(600):
    try:
      first = httpx.post(f'{url}/v1/completions', json={'prompt': 't5'}, timeout=30)
      break
    except httpx.TransportError:
      assert proc.poll() is None, open(log.name).read()
      time.sleep(0.05)
  for _ in range(600):  # until the warm-up is done, the idle one too (calls are counted)
    health = httpx.get(f'{url}/health')
    if health.status_code == 200 and health.json()['warmed'] == health.json()['to_warm']:
      break
    time.sleep(0.2)
  yield run, url, proc, first
  if proc.poll() is None:
    proc.kill()
    proc.wait()
  log.close()


@pytest.fixture(scope='module')
def client(served):
  return openai.OpenAI(base_url=served[1] + '/v1', api_key='none', max_retries=0)


def _generate_cli(run, prompts) -> list:
  """`python -m dlmjax.generate`'s printed completions (in this process)."""
  argv = ['--checkpoint-path', run, *FLAGS, '--batch-size', '8']
  for p in prompts:
    argv += ['--prompt', p]
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    assert generate.main(argv) == 0
  return out.getvalue().split('\n')[: len(prompts)]


def _error(response) -> dict:
  body = response.json()
  assert set(body) == {'error'} and {'message', 'type', 'param', 'code'} <= set(body['error'])
  return body['error']


@contextlib.contextmanager
def _compile_logging(caplog):
  """Every compilation inside the block logged to caplog (a test then finds none)."""
  caplog.set_level(logging.WARNING)
  jax.config.update('jax_log_compiles', True)
  try:
    yield
  finally:
    jax.config.update('jax_log_compiles', False)


def test_a_request_while_compiling_gets_503(served):
  first = served[3]
  assert first.status_code == 503 and first.headers['Retry-After']
  assert _error(first)['code'] == 'compiling'


def test_models_and_health(served, client):
  assert [m.id for m in client.models.list().data] == ['run']
  health = httpx.get(served[1] + '/health').json()
  assert health['status'] == 'ok' and health['compiled']  # the buckets compiled, logged
  # Both width buckets: the one-token prompt's (32) at start-up, the other (64) while idle.
  assert health['warmed'] == health['to_warm'] == 4
  assert {c.split(',')[0] for c in health['compiled']} == {
    'batch 16 x length 32',
    'batch 16 x length 64',
  }


def test_greedy_text_is_the_same_alone_batched_streamed_and_generated(served, client):
  run, url, _, _ = served
  calls = httpx.get(url + '/health').json()['calls']
  alone = [client.completions.create(model='run', prompt=p).choices[0].text for p in PROMPTS[:4]]
  # Alone, a job's first block is a call, its other three one more (--blocks-per-call 4).
  assert httpx.get(url + '/health').json()['calls'] - calls == 2 * 4
  results, streamed = [None] * len(PROMPTS), {}

  def one(i):
    time.sleep(0.01 * i)  # joins at different times: other requests are blocks into theirs
    if i % 4 == 1:  # every fourth one streamed from the shared batch
      chunks = list(client.completions.create(model='run', prompt=PROMPTS[i], stream=True))
      streamed[i] = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
      results[i] = chunks[-2]
    else:
      results[i] = client.completions.create(model='run', prompt=PROMPTS[i])

  calls = httpx.get(url + '/health').json()['calls']
  threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  texts = {i: ''.join(streamed[i]) for i in streamed}
  batched = [texts.get(i, r.choices[0].text) for i, r in enumerate(results)]
  # A job takes gen_length / block_length calls: 16 jobs share rounds (how many depends on when
  # each joins), fewer calls than one per job and block.
  per_job = SETTINGS['gen_length'] // SETTINGS['block_length']
  assert httpx.get(url + '/health').json()['calls'] - calls < len(PROMPTS) * per_job
  assert batched[:4] == alone
  assert batched == _generate_cli(run, PROMPTS)
  assert all(r.choices[0].finish_reason in ('stop', 'length') for r in results)
  assert all(len(streamed[i]) > 1 for i in streamed)  # an event per committed block

  chunks = list(client.completions.create(model='run', prompt=PROMPTS[5], stream=True))
  texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
  assert ''.join(texts) == batched[5]
  # One event per committed block, the three decoded in one call too, not one at the end.
  assert len(texts) == -(-chunks[-1].usage.completion_tokens // SETTINGS['block_length']) > 1
  assert chunks[-2].choices[0].finish_reason in ('stop', 'length')
  one_result = client.completions.create(model='run', prompt=PROMPTS[0])
  assert one_result.usage.prompt_tokens == 1 and one_result.usage.completion_tokens > 0

  listed = client.completions.create(model='run', prompt=PROMPTS[:3], n=2)
  assert [c.text for c in listed.choices] == [t for t in batched[:3] for _ in range(2)]


def test_chat_uses_the_checkpoint_template(client):
  reply = client.chat.completions.create(
    model='run', messages=[{'role': 'user', 'content': PROMPTS[2]}]
  )
  text = client.completions.create(model='run', prompt=PROMPTS[2]).choices[0].text
  assert reply.choices[0].message.content == text  # template 'none' = the raw user text
  assert reply.choices[0].message.role == 'assistant' and reply.id.startswith('chatcmpl-')
  streamed = client.chat.completions.create(
    model='run', messages=[{'role': 'user', 'content': PROMPTS[2]}], stream=True
  )
  assert ''.join(c.choices[0].delta.content or '' for c in streamed if c.choices) == text


def test_dlm_fields_and_stop(client):
  text = client.completions.create(model='run', prompt=PROMPTS[3]).choices[0].text
  stop = text.split()[2]
  cut = client.completions.create(model='run', prompt=PROMPTS[3], stop=[stop])
  assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == 'stop'
  ids = [int(t[1:]) for t in PROMPTS[3].split()]
  assert client.completions.create(model='run', prompt=ids).choices[0].text == text  # token ids
  fewer = client.completions.create(
    model='run', prompt=PROMPTS[3], max_tokens=8, extra_body={'steps': 8, 'cache': 'dual'}
  )
  assert fewer.choices[0].finish_reason == 'length' and fewer.usage.completion_tokens == 8


@pytest.mark.parametrize(
  'body, status, param',
  [
    ({'prompt': 't5 ' * 30}, 400, 'prompt'),  # longer than the model allows
    ({'prompt': 't5', 'cache': 'bogus'}, 400, None),  # an unknown field value
    ({'prompt': 't5', 'remasking': 'sideways'}, 400, None),
    ({'prompt': 't5', 'n': 0}, 400, 'n'),
    ({'prompt': 't5', 'n': 'two'}, 400, 'n'),
    ({'prompt': ''}, 400, 'prompt'),
    ({'prompt': []}, 400, 'prompt'),
    ({'prompt': [5, 999]}, 400, 'prompt'),  # a token id outside the vocabulary
    ({'prompt': {'text': 't5'}}, 400, 'prompt'),
    ({'prompt': 't5', 'max_tokens': 6}, 400, None),  # not a multiple of block_length
    ({'prompt': 't5', 'temperature': -1}, 400, 'temperature'),
    ({'prompt': 't5', 'logprobs': 2}, 400, 'logprobs'),
    ({'prompt': 't5', 'model': 'gpt-9'}, 404, 'model'),
    ({'messages': 'hello'}, 400, 'messages'),
  ],
)
def test_bad_input_gets_an_openai_error(served, body, status, param):
  path = '/v1/chat/completions' if 'messages' in body else '/v1/completions'
  response = httpx.post(served[1] + path, json=body)
  assert response.status_code == status, response.text
  assert _error(response)['param'] == param


def test_multi_block_decoding_is_refused_not_ignored(served):
  """The server decodes block by block: d3LLM's multi-block loop would be silently dropped."""
  body = {'prompt': 't5', 'block_add_threshold': 0.1, 'entropy_threshold': 0.5}
  response = httpx.post(served[1] + '/v1/completions', json=body)
  assert response.status_code == 400 and 'block by block' in _error(response)['message']


def test_malformed_json_and_unknown_routes(served):
  response = httpx.post(
    served[1] + '/v1/completions', content=b'{"prompt": ', headers={'content-type': 'json'}
  )
  assert response.status_code == 400 and 'JSON' in _error(response)['message']
  assert httpx.get(served[1] + '/v1/nothing').status_code == 404
  assert httpx.get(served[1] + '/v1/completions').status_code == 405


def test_the_openai_client_raises_on_errors(client):
  with pytest.raises(openai.BadRequestError, match='context'):
    client.completions.create(model='run', prompt='t5 ' * 30)


def test_a_gone_client_stops_decoding(served):
  url = served[1]
  before = httpx.get(url + '/health').json()
  body = {'prompt': PROMPTS[1], 'stream': True, 'max_tokens': 16}
  with httpx.stream('POST', url + '/v1/completions', json=body) as response:
    for line in response.iter_lines():
      if line.startswith('data: {'):
        break  # the first block arrived; hang up
  for _ in range(100):
    health = httpx.get(url + '/health').json()
    if health['cancelled'] > before['cancelled'] and health['decoding'] == 0:
      break
    time.sleep(0.1)
  assert health['cancelled'] == before['cancelled'] + 1 and health['decoding'] == 0
  assert httpx.post(url + '/v1/completions', json={'prompt': 't5'}).status_code == 200


def test_a_full_queue_gets_503_and_the_server_keeps_serving(served):
  url = served[1]
  bodies = [{'prompt': PROMPTS[i % 16], 'n': 8} for i in range(8)]  # 64 jobs: 16 slots + 24 queued
  codes = [None] * len(bodies)

  def one(i):
    response = httpx.post(url + '/v1/completions', json=bodies[i], timeout=120)
    codes[i] = (response.status_code, response.headers.get('Retry-After'))

  threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert (200, None) in codes and (503, '1') in codes
  assert httpx.post(url + '/v1/completions', json={'prompt': 't5'}).status_code == 200


def test_sigterm_drains_then_exits_0(served):  # last: it stops the module's server
  _, url, proc, _ = served
  result = {}

  def streamed():
    with httpx.stream('POST', url + '/v1/completions', json={'prompt': 't5', 'stream': True}) as r:
      result['lines'] = [line for line in r.iter_lines() if line]

  thread = threading.Thread(target=streamed)
  thread.start()
  time.sleep(0.3)
  proc.send_signal(signal.SIGTERM)
  thread.join(timeout=60)
  assert proc.wait(timeout=60) == 0
  assert result['lines'][-1] == 'data: [DONE]'
  finals = [json.loads(line[6:]) for line in result['lines'][:-1]]
  assert any(f['choices'] and f['choices'][0]['finish_reason'] for f in finals)


@pytest.mark.parametrize('cache', ['none', 'block'])
def test_block_causal_jobs_joining_mid_decode_get_generates_text(tmp_path, cache):
  """A block-causal model's rows end with their current block (nothing after it is visible),
  or with their last block of a multi-block call, their prompts' ends open their first blocks:
  jobs that join while others are blocks into theirs, with two max_tokens sharing programs,
  decode generate's text, one block a call while some wait, up to 3 when none does. The block
  start is a runtime argument (the block cache prefills to the canvas's last block): one
  program a bucket serves both."""
  model = dlmjax.load_pretrained(_make_run(tmp_path, 'block_causal'))
  eng = engine.Engine(
    model,
    max_batch=4,
    max_queue=8,
    buckets=engine.Buckets(batch=(1, 2, 4), width=(32,)),
    blocks_per_call=3,
  )
  eng.start()
  long = sampling_config.SamplingConfig(**SETTINGS, cache=cache)
  short = dataclasses.replace(long, gen_length=8, steps=4)
  settings = [long if i % 2 else short for i in range(8)]
  jobs = [
    engine.Job(prompt=model.tokenizer.encode(p), settings=s) for p, s in zip(PROMPTS, settings)
  ]
  for i, job in enumerate(jobs):
    eng.submit(job)
    if i == 2:  # the first three are a block or two in when the rest join
      for _ in range(200):
        if eng.calls >= 2:
          break
        time.sleep(0.01)
  assert eng.drain(timeout=120)
  for gen in (8, 16):
    chosen = [i for i in range(8) if settings[i].gen_length == gen]
    expected = model.generate(
      [PROMPTS[i] for i in chosen],
      batch_size=8,
      **SETTINGS | {'gen_length': gen, 'steps': gen // 2, 'cache': cache},
    )
    assert [jobs[i].text for i in chosen] == expected
  assert all(j.chunks > 1 for j in jobs) and len(eng.compiled) <= 3  # one a batch bucket
  assert eng.calls < sum(j.chunks for j in jobs) and eng.slots <= 4 * eng.calls
  assert eng.blocks > eng.calls  # some calls decoded several blocks


def test_pipelined_calls_carry_blocks_on_the_device_and_drop_a_stopped_jobs_next(tmp_path):
  """The next block is dispatched before the current one's tokens are taken: continuing rows
  take their last block from the device (generate's text), and a job a stop string ends keeps
  nothing of the block already dispatched for it."""
  model = dlmjax.load_pretrained(_make_run(tmp_path))
  eng = engine.Engine(
    model, max_batch=2, max_queue=4, buckets=engine.Buckets(batch=(1, 2), width=(32,))
  )
  expected = model.generate(PROMPTS[:6], batch_size=6, **SETTINGS)
  long = next(i for i, t in enumerate(expected) if len(model.tokenizer.encode(t)) >= 12)
  other = (long + 1) % 6
  stop = model.tokenizer.decode(model.tokenizer.encode(expected[long])[:6])  # in block 2 of 4
  settings = sampling_config.SamplingConfig(**SETTINGS)
  jobs = [
    engine.Job(prompt=model.tokenizer.encode(PROMPTS[other]), settings=settings),
    engine.Job(prompt=model.tokenizer.encode(PROMPTS[long]), settings=settings, stop=(stop,)),
  ]
  for job in jobs:
    eng.submit(job)
  eng.start()
  assert eng.drain(timeout=120)
  assert jobs[0].text == expected[other] and jobs[0].finish_reason in ('stop', 'length')
  assert (jobs[1].text, jobs[1].finish_reason, jobs[1].chunks) == ('', 'stop', 2)
  assert eng.carried >= 3 and eng.rows > sum(j.chunks for j in jobs)  # block 3 was in flight
  assert all(j.inflight == 0 for j in jobs) and 0 < eng.busy_s


@pytest.mark.parametrize('attention', ['causal', 'block_causal'])
def test_a_shared_system_prompt_is_prefilled_once_and_reused_exactly(tmp_path, attention):
  """With the block cache on a causal or block-causal model, the engine stores the K/V of the
  prefix two prompts share and later calls prefill only what follows it in each row: the text
  is generate's, and the reuse happened (a wrong placement of the stored K/V changes the text).
  Calls of up to 2 blocks: the cache appends each block's K/V for the next inside the call."""
  model = dlmjax.load_pretrained(_make_run(tmp_path, attention, **{'model.seq_len': 64}))
  system = ' '.join(f't{100 + 3 * j % 150}' for j in range(21))  # 21 tokens: one 16-token unit
  prompts = [f'{system} {p}' for p in PROMPTS[:5]]
  settings = sampling_config.SamplingConfig(**SETTINGS, cache='block')
  expected = model.generate(prompts, batch_size=5, **SETTINGS, cache='block')
  eng = engine.Engine(
    model,
    max_batch=4,
    max_queue=8,
    buckets=engine.Buckets(batch=(1, 2, 4), width=(40, 64)),
    prefix_cache=2,
    blocks_per_call=2,
  )
  jobs = [engine.Job(prompt=model.tokenizer.encode(p), settings=settings) for p in prompts]
  for job in jobs:
    eng.submit(job)
  eng.start()
  assert eng.drain(timeout=120)
  assert [j.text for j in jobs] == expected
  stats = eng.stats()
  assert stats['prefixes'] == 1 and list(eng.prefixes) == [tuple(jobs[0].prompt[:16])]
  assert stats['prefix_rows'] == eng.rows and stats['prefill_skipped'] > 0
  assert stats['blocks'] > stats['calls']


def test_a_lone_groups_multi_block_calls_end_jobs_mid_call_and_admit_a_late_job_next_call(tmp_path):
  """With blocks_per_call 4, jobs past their first block decode up to 4 blocks a call while
  nothing waits: a job whose stop string or EOS falls inside such a call keeps generate's text
  up to it and nothing after, and a job that arrives while a multi-block call runs joins the
  very next call (one block, beside the others) and decodes generate's text."""
  model = dlmjax.load_pretrained(_make_run(tmp_path))
  settings = sampling_config.SamplingConfig(gen_length=24, steps=12, block_length=4)  # 6 blocks
  prompts = [PROMPTS[0], PROMPTS[9], PROMPTS[10], PROMPTS[2]]  # the last one arrives late
  expected = [model.tokenizer.encode(t) for t in model.generate(prompts, **vars(settings))]
  decode = model.tokenizer.decode
  # Job 1 stops at a stop string, job 2 at an EOS-like piece (the engine's stop ids, as EOS),
  # each first complete in one of blocks 1-3: inside the call of blocks 1-4, not its last.
  stop, piece = 't185 t252', 41
  stop_block = next(b for b in range(6) if stop in decode(expected[1][: 4 * b + 4]))
  piece_block = expected[2].index(piece) // 4
  assert 1 <= stop_block < 4 and 1 <= piece_block < 4, 'the premise: ends inside call 2'
  cut = [e[: e.index(piece)] if piece in e else e for e in expected]
  eng = engine.Engine(
    model,
    max_batch=4,
    max_queue=4,
    buckets=engine.Buckets(batch=(1, 2, 4), width=(64,)),
    stop_piece=piece,
    blocks_per_call=4,
  )
  late = engine.Job(prompt=model.tokenizer.encode(prompts[3]), settings=settings)
  joined = []

  def arrive(job):  # at job 0's first block taken: the multi-block call is already running
    if not joined:
      joined.append(eng.calls)
      eng.submit(late)

  stops = [(), (stop,), ()]
  jobs = [
    engine.Job(prompt=model.tokenizer.encode(p), settings=settings, stop=s, on_update=arrive)
    for p, s in zip(prompts, stops)
  ]
  calls, dispatch = [], eng.dispatch

  def recorded(group, *args, **kwargs):  # each call's rows: (job, its blocks)
    call = dispatch(group, *args, **kwargs)
    calls.append([((jobs + [late]).index(j), n) for j, n in zip(call.group, call.blocks)])
    return call

  eng.dispatch = recorded
  for job in jobs:
    eng.submit(job)
  eng.start()
  for _ in range(1200):  # the late job is submitted by the engine's thread: drain after it
    if late.finish_reason is not None:
      break
    time.sleep(0.05)
  assert eng.drain(timeout=60)
  assert (jobs[0].text, late.text) == (decode(cut[0]), decode(cut[3]))
  text = decode(cut[1])
  assert (jobs[1].text, jobs[1].finish_reason) == (text[: text.find(stop)], 'stop')
  assert (jobs[2].text, jobs[2].finish_reason) == (decode(cut[2]), 'stop')
  # Each took its blocks up to the one it ended in, nothing of the call's later blocks.
  assert (jobs[1].chunks, jobs[2].chunks) == (stop_block + 1, piece_block + 1)
  assert calls[:2] == [[(0, 1), (1, 1), (2, 1)], [(0, 4), (1, 4), (2, 4)]]
  assert joined == [2] and calls[2] == [(0, 1), (1, 1), (2, 1), (3, 1)]  # the next call
  assert calls[3:] == [[(3, 4)], [(3, 1)]] and eng.blocks == 1 + 4 + 1 + 4 + 1


def test_a_blocking_dispatch_holds_back_neither_a_lone_jobs_first_block_nor_busy_time(
  tmp_path, caplog
):
  """Where a call's dispatch returns only once the device is done (XLA:GPU reads a
  data-dependent while loop's predicate on the host), a lone job's first block is still streamed
  while its next call (4 blocks) runs, and busy_s counts each call's device time; after warm,
  nothing compiles under the job."""
  model = dlmjax.load_pretrained(_make_run(tmp_path))
  settings = sampling_config.SamplingConfig(
    gen_length=24, steps=12, block_length=4
  )  # calls: 1, 4, 1
  eng = engine.Engine(
    model,
    max_batch=1,
    max_queue=1,
    buckets=engine.Buckets(batch=(1,), width=(64,)),
    blocks_per_call=4,
  )
  eng.warmup.run(settings)
  warm_calls, warm_busy, warm_dispatch = eng.calls, eng.busy_s, eng.dispatch_s
  streamed, device_s, program = threading.Event(), 0.05, eng._program  # pylint: disable=protected-access
  launched, first_block_before_call_2 = [], []

  def blocking(*key):  # a device whose dispatch returns when the call is done
    fn = program(*key)

    def call(*args):
      launched.append(None)
      if len(launched) == 2:  # the 4-block call is "running"
        first_block_before_call_2.append(streamed.wait(timeout=5))
      out = fn(*args)
      out.block_until_ready()
      time.sleep(device_s)
      return out

    return call

  eng._program = blocking  # pylint: disable=protected-access
  job = engine.Job(
    prompt=model.tokenizer.encode(PROMPTS[3]), settings=settings, on_update=lambda j: streamed.set()
  )
  with _compile_logging(caplog):
    eng.submit(job)
    eng.start()
    assert eng.drain(timeout=60)
  assert job.finish_reason == 'length' and (eng.calls - warm_calls, job.chunks) == (3, 6)
  assert first_block_before_call_2 == [True]
  assert eng.busy_s - warm_busy >= 3 * device_s and eng.dispatch_s - warm_dispatch >= 3 * device_s
  assert not [r.getMessage() for r in caplog.records if 'Compiling' in r.getMessage()]


def test_warm_skips_canvas_lengths_the_shortest_row_never_runs(tmp_path):
  """warm(prompt=P) compiles only the canvas lengths a row of a P-token prompt fits: a longer
  row never runs a shorter canvas (a 20-token prompt and 16 tokens: not the 32 bucket)."""
  model = dlmjax.load_pretrained(_make_run(tmp_path))
  eng = engine.Engine(
    model, max_batch=2, max_queue=2, buckets=engine.Buckets(batch=(1, 2), width=(32, 64))
  )
  dispatched = []
  eng.dispatch = lambda group, *_, shape, **__: dispatched.append(shape[:2])
  eng.wait = lambda call: None
  settings = sampling_config.SamplingConfig(**SETTINGS)
  eng.warmup.run(settings, (32, 64), prompt=20)
  assert dispatched == [(1, 64), (2, 64)]
  dispatched.clear()
  eng.warmup.run(settings, (32, 64), prompt=1)
  assert dispatched == [(1, 32), (1, 64), (2, 32), (2, 64)]


def test_warm_up_for_jobs_that_all_start_with_a_stored_prefix_skips_the_bare_rows(tmp_path):
  """warm(prefixed=True) (every job starts with a stored prefix: the load test's system prompt)
  plans only the calls of rows after a stored prefix; with none stored, the bare prompt's."""
  model = dlmjax.load_pretrained(_make_run(tmp_path, 'block_causal'))
  eng = engine.Engine(
    model, max_batch=2, max_queue=2, buckets=engine.Buckets(batch=(1, 2), width=(64,))
  )
  settings = sampling_config.SamplingConfig(**SETTINGS, cache='block')

  def prompts(prefixed):
    units = eng.warmup.units(settings, prompt=17, prefixed=prefixed)
    return {tuple(group[0].prompt) for group, *_ in units}

  pad = model.config.model.pad_token_id
  assert prompts(True) == prompts(False) == {(pad,) * 17}
  system = tuple(range(5, 21))
  eng.prefixes[system] = None  # a stored prefix; planning reads its tokens only
  assert prompts(False) == {(pad,) * 17, (*system, pad)}
  assert prompts(True) == {(*system, pad)}


def test_a_stored_prefixs_warm_up_calls_need_warm_up_on_and_the_prefix_still_stored(tmp_path):
  """plan_prefix queues nothing unless the warm-up was planned (--no-warmup: compile on first
  use); a prefix's calls run its rows' shapes at every bucket, and those of a prefix evicted
  before they ran are dropped, neither run (no row runs them) nor counted."""
  model = dlmjax.load_pretrained(_make_run(tmp_path, 'block_causal'))
  eng = engine.Engine(
    model, max_batch=2, max_queue=2, buckets=engine.Buckets(batch=(1, 2), width=(32, 64))
  )
  dispatched = []
  eng.dispatch = lambda group, *_, shape, **__: dispatched.append((group[0].prompt, shape[:2]))
  eng.wait = lambda call: None  # no call's blocks to carry: a new row's calls only
  settings = sampling_config.SamplingConfig(**SETTINGS, cache='block')
  kept, evicted = tuple(range(5, 21)), tuple(range(21, 37))
  eng.warmup.plan_prefix(kept, settings)
  assert not eng.warmup.queue and eng.warmup.total == 0
  eng.warmup.plan(settings)
  planned = eng.warmup.total
  for tokens in (kept, evicted):
    eng.prefixes[tokens] = None  # stored; planning reads the tokens only
    eng.warmup.plan_prefix(tokens, settings)
  del eng.prefixes[evicted]
  while eng.warmup.queue:
    eng.warmup.next()
  pad = model.config.model.pad_token_id
  after = [shape for prompt, shape in dispatched if prompt == [*kept, pad]]
  assert after == [(1, 32), (1, 64), (2, 32), (2, 64)] and len(dispatched) == planned // 2 + 4
  assert eng.warmup.done == eng.warmup.total == planned + 8


def test_idle_warm_up_compiles_every_width_bucket_between_requests_never_beside_one(
  tmp_path, caplog
):
  """After the start-up warm-up (a one-token prompt's canvas, 32), the idle scheduler compiles
  the other width bucket's calls (64) one at a time: a request arriving during the first waits
  for it, decodes generate's text with no warm-up call beside it, and the warm-up then resumes;
  afterwards a prompt that needs the 64 canvas compiles nothing."""
  model = dlmjax.load_pretrained(_make_run(tmp_path, **{'model.seq_len': 64}))
  short, long = PROMPTS[3], ' '.join(PROMPTS[10:15])  # canvases 32 and 64 (17 + 16 tokens)
  expected = model.generate([short, long], batch_size=2, **SETTINGS)
  settings = sampling_config.SamplingConfig(**SETTINGS)
  eng = engine.Engine(
    model, max_batch=1, max_queue=2, buckets=engine.Buckets(batch=(1,), width=(32, 64))
  )
  jobs = [engine.Job(prompt=model.tokenizer.encode(p), settings=settings) for p in (short, long)]
  kinds, dispatch = [], eng.dispatch

  def recorded(group, *args, **kwargs):  # each call: its kind and whether a job was decoding
    if group[0] in jobs:
      kinds.append('job')
    else:
      kinds.append('start-up' if eng.compiling else 'idle')
      assert not eng.active and kinds.count('job') % 4 == 0, 'a warm-up call beside a job'
      if kinds.count('idle') == 1:  # a request arrives while the first idle call compiles
        eng.submit(jobs[0])
    return dispatch(group, *args, **kwargs)

  eng.dispatch = recorded
  eng.start(warmup=settings)
  for _ in range(1200):
    if eng.stats()['warmed'] == eng.stats()['to_warm'] and jobs[0].finish_reason:
      break
    time.sleep(0.05)
  assert (eng.stats()['warmed'], eng.stats()['to_warm']) == (4, 4)
  # A new row's call and a continuing row's at each bucket; the job's 4 blocks between idle's.
  assert kinds == ['start-up'] * 2 + ['idle'] + ['job'] * 4 + ['idle']
  assert {(b, n) for _, b, n, _, _ in eng.compiled} == {(1, 32), (1, 64)}
  with _compile_logging(caplog):
    eng.submit(jobs[1])
    assert eng.drain(timeout=60)
  assert [j.text for j in jobs] == expected
  assert not [r.getMessage() for r in caplog.records if 'Compiling' in r.getMessage()]


def test_a_stored_prefix_queues_its_programs_for_the_idle_warm_up(tmp_path, caplog):
  """Two requests that share a system prompt, arriving during the default warm-up's idle calls,
  store it and decode in the 32 canvas; the scheduler then compiles, while idle, the programs
  of rows after it at every width bucket, never beside a job: a later request with it in the 64
  canvas compiles nothing."""
  model = dlmjax.load_pretrained(_make_run(tmp_path, 'block_causal', **{'model.seq_len': 64}))
  system = ' '.join(f't{100 + 3 * j % 150}' for j in range(21))  # one 16-token unit stored
  prompts = [f'{system} {p}' for p in (PROMPTS[0], PROMPTS[1], ' '.join(PROMPTS[10:13]))]
  settings = sampling_config.SamplingConfig(gen_length=8, steps=4, block_length=4, cache='block')
  eng = engine.Engine(
    model,
    max_batch=2,
    max_queue=2,
    buckets=engine.Buckets(batch=(2,), width=(32, 64)),
    prefix_cache=1,
  )
  jobs = [engine.Job(prompt=model.tokenizer.encode(p), settings=settings) for p in prompts]
  kinds, dispatch = [], eng.dispatch

  def recorded(group, *args, **kwargs):  # each call: its kind and whether a job was decoding
    if group[0] in jobs:
      kinds.append('job')
    else:
      kinds.append('start-up' if eng.compiling else 'idle')
      assert not eng.active and not eng.waiting, 'a warm-up call beside a job'
      if kinds.count('idle') == 2:  # the two arrive during the default warm-up's last call
        eng.submit(jobs[0])
        eng.submit(jobs[1])
    return dispatch(group, *args, **kwargs)

  eng.dispatch = recorded
  eng.start(warmup=settings)
  for _ in range(1200):
    if eng.stats()['warmed'] == eng.stats()['to_warm'] and jobs[1].finish_reason:
      break
    time.sleep(0.05)
  # The default settings' 4 calls (2 widths: a new row's and a continuing one's), the jobs' 3
  # blocks (the first keeps the prompt's tokens after its last whole model block), then the 4
  # calls after the stored prefix.
  assert (eng.stats()['warmed'], eng.stats()['to_warm']) == (8, 8)
  assert kinds == ['start-up'] * 2 + ['idle'] * 2 + ['job'] * 3 + ['idle'] * 4
  assert list(eng.prefixes) == [tuple(jobs[0].prompt[:16])]
  assert {n for _, _, n, _, window in eng.compiled if window is not None} == {32, 64}
  before = eng.prefix_rows
  with _compile_logging(caplog):
    eng.submit(jobs[2])
    assert eng.drain(timeout=60)
  assert jobs[2].finish_reason and kinds[4 + 3 + 4 :] == ['job'] * 3
  assert eng.prefix_rows - before == 3  # its every call ran after the stored prefix
  assert not [r.getMessage() for r in caplog.records if 'Compiling' in r.getMessage()]


def test_a_seeded_sampled_jobs_text_does_not_depend_on_how_its_blocks_are_split_into_calls(
  tmp_path,
):
  """A seeded job at temperature > 0 draws each block's keys from its seed and the block's index
  in the whole decode (sampler.decode_canvas_blocks' first_index), so one block a call and four
  blocks a call give the same text, as the seed promises whatever the server's load."""
  model = dlmjax.load_pretrained(_make_run(tmp_path))
  settings = sampling_config.SamplingConfig(
    gen_length=24, steps=12, block_length=4, temperature=0.9
  )  # 6 blocks
  texts = []
  for blocks_per_call in (1, 4):
    eng = engine.Engine(
      model,
      max_batch=1,
      max_queue=1,
      buckets=engine.Buckets(batch=(1,), width=(64,)),
      blocks_per_call=blocks_per_call,
    )
    job = engine.Job(prompt=model.tokenizer.encode(PROMPTS[0]), settings=settings, seed=7)
    eng.submit(job)
    eng.start()
    assert eng.drain(timeout=120)
    assert eng.blocks > eng.calls or blocks_per_call == 1  # four a call did happen
    texts.append((job.text, job.finish_reason))
  assert texts[0] == texts[1] and texts[0][0]


def test_closed_loop_clients_share_every_call_at_steady_state(tmp_path):
  """N clients that each send their next request a moment (3 ms: an HTTP turn-around) after
  their last one ends (a call takes 60 ms), half of them arriving once the first half's first
  two calls (1 block, then 3) are dispatched: once every client is in its loop, each call
  carries close to N rows, and texts stay generate's. Without the engine's hold for the clients
  of jobs that just ended, the two halves alternated for ever, each shut out of the other's
  multi-block call (4.0 rows a call of 8)."""
  clients, rounds = 8, 5
  model = dlmjax.load_pretrained(_make_run(tmp_path))
  settings = sampling_config.SamplingConfig(**SETTINGS)  # 4 blocks: a call of 1, then of 3
  expected = model.generate(PROMPTS[:clients], batch_size=clients, **SETTINGS)
  eng = engine.Engine(
    model,
    max_batch=clients,
    max_queue=clients,
    buckets=engine.Buckets(batch=(clients,), width=(32,)),
    blocks_per_call=4,
  )
  eng.warmup.run(settings)
  program = eng._program  # pylint: disable=protected-access

  def timed(*key):  # a call takes 60 ms, as a device's would, its dispatch returning then
    fn = program(*key)
    return lambda *args: time.sleep(0.06) or jax.block_until_ready(fn(*args))

  eng._program = timed  # pylint: disable=protected-access
  calls, running, lock, dispatch = [], [0], threading.Lock(), eng.dispatch

  def recorded(group, *args, **kwargs):  # each call's rows, and whether every client was looping
    calls.append((len(group), running[0] == clients))
    return dispatch(group, *args, **kwargs)

  eng.dispatch = recorded
  eng.start()
  texts = [[] for _ in range(clients)]

  def client(i):
    for r in range(rounds):
      ended = threading.Event()
      job = engine.Job(
        prompt=model.tokenizer.encode(PROMPTS[i]),
        settings=settings,
        on_update=lambda j, ended=ended: j.finish_reason and ended.set(),
      )
      with lock:  # from its second request to its last one's end, a client is in its loop
        eng.submit(job)
        running[0] += r == 1
      assert ended.wait(timeout=60)
      texts[i].append(job.text)
      with lock:
        running[0] -= r == rounds - 1
      time.sleep(0.003)

  threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
  for i, t in enumerate(threads):
    t.start()
    while i == clients // 2 - 1 and len(calls) < 2:  # half arrive after the first two calls
      time.sleep(0.001)
  for t in threads:
    t.join()
  assert eng.drain(timeout=60)
  assert texts == [[e] * rounds for e in expected]
  steady = [rows for rows, looping in calls if looping]
  assert len(steady) >= 4 and sum(steady) / len(steady) >= 0.75 * clients, calls
  assert eng.blocks > eng.calls  # the lone group's several blocks a call still happen
