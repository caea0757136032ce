"""The OpenAI HTTP API over the engine: /v1/models, /v1/completions, /v1/chat/completions, /health.

Request bodies are read by hand (not by pydantic models), so every bad input gets OpenAI's error
shape, {"error": {"message", "type", "param", "code"}}, with one line naming the field and the
fix. The DLM settings (SamplingConfig's fields: steps, block_length, threshold, cache, remasking,
cfg_scale, ...) are extra body fields; each defaults to the server's flags, max_tokens to
--gen-length. Streams are server-sent events: a chunk per committed block, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import time
import uuid

import fastapi
import uvicorn
from fastapi import responses

from dlmjax import inference
from dlmjax.data import chat
from dlmjax.data.errors import DataError
from dlmjax.diffusion import sampling_config
from dlmjax.serve import engine as engine_lib

# OpenAI fields dlmjax cannot honour: refused when set to anything but their default.
UNSUPPORTED = {
  'logprobs': (None, False, 0),
  'top_logprobs': (None, 0),
  'echo': (None, False),
  'suffix': (None, ''),
  'best_of': (None, 1),
  'logit_bias': (None, {}),
  'tools': (None, []),
  'tool_choice': (None, 'none'),
  'response_format': (None, {'type': 'text'}),
}
DLM_FIELDS = tuple(
  f for f in sampling_config.FIELDS if f != 'gen_length'
)  # max_tokens is gen_length.
MAX_STOPS = 4  # OpenAI's limit on `stop` strings.


class APIError(Exception):
  def __init__(self, status, message, *, param=None, code=None, kind='invalid_request_error'):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
    self.headers = {}


def error_response(e: APIError) -> responses.JSONResponse:
  body = {'error': {'message': e.message, 'type': e.kind, 'param': e.param, 'code': e.code}}
  return responses.JSONResponse(body, status_code=e.status, headers=e.headers)


def _number(body, name, kind, *, low=None, high=None, low_open=False):
  value = body[name]
  if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
    raise APIError(400, f'{name} must be {"a number" if kind is float else "an integer"}, '
                        f'got {value!r:.40}.', param=name)  # fmt: skip
  if (low is not None and (value <= low if low_open else value < low)) or (
    high is not None and value > high
  ):
    bounds = f'{"(" if low_open else "["}{low}, {high if high is not None else "inf"}]'
    raise APIError(400, f'{name}={value} is out of range; give a value in {bounds}.', param=name)
  return kind(value)


def _is_id(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_prompt(value) -> bool:
  return isinstance(value, str) or (isinstance(value, list) and all(_is_id(t) for t in value))


@dataclasses.dataclass
class Parsed:
  prompts: list  # token id lists
  settings: sampling_config.SamplingConfig
  n: int
  seed: int | None
  stop: tuple
  stream: bool


class Server:
  """The request handling: body -> jobs -> OpenAI response or event stream."""

  def __init__(self, eng, *, defaults, model_name, chat_template, retry_after_s=1):
    self.engine, self.defaults, self.model_name = eng, defaults, model_name
    self.chat_template, self.retry_after_s = chat_template, retry_after_s
    self.tokenizer = eng.model.tokenizer
    self.created = int(time.time())

  def settings(self, body) -> sampling_config.SamplingConfig:
    """The request's SamplingConfig: its DLM fields over the server's defaults. max_tokens
    alone keeps the default block_length (or max_tokens, if smaller) and tokens per step."""
    values = {}
    for name in DLM_FIELDS + ('temperature', 'top_p'):
      if body.get(name) is not None:
        values[name] = body[name]
    d = self.defaults
    if body.get('max_tokens') is not None:
      gen = _number(body, 'max_tokens', int, low=1)
      values['gen_length'] = gen
      values.setdefault('block_length', min(d.block_length, gen))
      if 'steps' not in values and gen % values['block_length'] == 0:
        blocks = gen // values['block_length']
        per_block = max(1, round(d.steps / d.gen_length * values['block_length']))
        values['steps'] = blocks * per_block
    for name in ('temperature',):
      if name in values:
        _number(values, name, float, low=0)
    if 'top_p' in values:
      _number(values, 'top_p', float, low=0, high=1, low_open=True)
    for name, value in values.items():
      default = getattr(d, name)
      if isinstance(default, str) and not isinstance(value, str):
        raise APIError(400, f'{name} must be a string, got {value!r:.40}.', param=name)
      if isinstance(default, bool) and not isinstance(value, bool):
        raise APIError(400, f'{name} must be true or false, got {value!r:.40}.', param=name)
      if isinstance(default, (int, float)) and not isinstance(default, bool):
        _number(values, name, type(default) if isinstance(default, float) else int)
    try:
      settings = dataclasses.replace(d, **values).validate()
    except ValueError as e:
      message = str(e).replace('gen_length', 'max_tokens')
      raise APIError(400, message, code='invalid_value') from e
    return settings

  def parse(self, body, prompts) -> Parsed:
    """Checks the fields every endpoint shares; prompts are text."""
    if body.get('model') not in (None, self.model_name):
      raise APIError(
        404, f'the model {body["model"]!r} is not served here; this server serves '
        f'{self.model_name!r} (GET /v1/models).', param='model', code='model_not_found',
      )  # fmt: skip
    for name, allowed in UNSUPPORTED.items():
      if body.get(name, None) not in allowed:
        raise APIError(400, f'{name} is not supported by dlmjax; leave it out.', param=name)
    n = 1 if body.get('n') is None else _number(body, 'n', int, low=1, high=self.engine.max_batch)
    seed = _number(body, 'seed', int) if body.get('seed') is not None else None
    stop = body.get('stop') or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
      raise APIError(400, 'stop must be a string or a list of non-empty strings.', param='stop')
    if len(stop) > MAX_STOPS:
      raise APIError(400, f'stop has {len(stop)} strings; give at most {MAX_STOPS}.', param='stop')
    stream = body.get('stream', False)
    if not isinstance(stream, bool):
      raise APIError(400, f'stream must be true or false, got {stream!r:.40}.', param='stream')
    settings = self.settings(body)
    ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    for i, tokens in enumerate(ids):
      if not tokens:
        raise APIError(400, f'prompt {i} is empty; send some text.', param='prompt')
      try:
        self.engine.check(engine_lib.Job(prompt=tokens, settings=settings))
      except ValueError as e:
        raise APIError(400, str(e), param='prompt', code='context_length_exceeded') from e
    return Parsed(ids, settings, n, seed, tuple(stop), stream)

  def completion_prompts(self, body) -> list:
    """Text prompts, or token-id prompts (a list of ints, or of such lists), as OpenAI's."""
    prompt = body.get('prompt')
    one_ids = isinstance(prompt, list) and prompt and all(map(_is_id, prompt))
    if isinstance(prompt, str) or one_ids:
      prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(_is_prompt(p) for p in prompt):
      raise APIError(
        400,
        'prompt must be a string, a list of token ids, or a non-empty list of either.',
        param='prompt',
      )
    vocab = self.engine.model.vocab_size
    for p in prompt:
      if not isinstance(p, str) and any(not 0 <= t < vocab for t in p):
        raise APIError(400, f'a prompt token id lies outside [0, {vocab}).', param='prompt')
    return prompt

  def chat_prompt(self, body) -> list:
    messages = body.get('messages')
    try:
      return [chat.render(self.chat_template, messages, add_generation_prompt=True)]
    except DataError as e:
      raise APIError(400, str(e), param='messages') from e

  # ---- running jobs ----

  def submit(self, parsed: Parsed, loop, queue) -> list:
    """The jobs of a request (each prompt n times), submitted; their updates go to queue as
    (choice index, text so far, finish reason, token count)."""
    jobs = []
    for i, tokens in enumerate(parsed.prompts):
      for j in range(parsed.n):
        index = len(jobs)

        def update(job, index=index):
          item = (index, job.text, job.finish_reason, len(job.tokens), job.error)
          loop.call_soon_threadsafe(queue.put_nowait, item)

        seed = None if parsed.seed is None else parsed.seed + j
        jobs.append(
          engine_lib.Job(
            prompt=tokens, settings=parsed.settings, seed=seed, stop=parsed.stop, on_update=update
          )
        )
    try:
      for job in jobs:
        self.engine.submit(job)
    except (engine_lib.QueueFull, engine_lib.Compiling) as e:
      for job in jobs:
        self.engine.cancel(job)
      compiling = isinstance(e, engine_lib.Compiling)
      error = APIError(
        503,
        'the server is compiling its sampler programs; retry shortly.'
        if compiling
        else 'the server is shutting down; send the request to another replica.'
        if self.engine.draining
        else f'the request queue is full ({self.engine.max_queue} waiting); retry shortly.',
        code='compiling' if compiling else 'queue_full',
        kind='server_error',
      )
      error.headers['Retry-After'] = str(self.retry_after_s)
      raise error from e
    return jobs

  def usage(self, parsed, counts) -> dict:
    prompt = sum(len(p) for p in parsed.prompts) * parsed.n
    done = sum(counts)
    return {'prompt_tokens': prompt, 'completion_tokens': done, 'total_tokens': prompt + done}

  async def run(self, request, parsed: Parsed, kind: str):
    """The whole response (stream=false) or a StreamingResponse of its events."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    jobs = self.submit(parsed, loop, queue)
    rid = ('chatcmpl-' if kind == 'chat' else 'cmpl-') + uuid.uuid4().hex[:24]
    if parsed.stream:
      return responses.StreamingResponse(
        self._events(jobs, queue, parsed, kind, rid), media_type='text/event-stream'
      )
    texts, reasons, counts = [''] * len(jobs), [None] * len(jobs), [0] * len(jobs)
    try:
      while any(r is None for r in reasons):
        try:
          index, text, reason, count, error = await asyncio.wait_for(queue.get(), 0.5)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            return responses.Response(status_code=499)  # nobody reads it; the jobs stop below
          continue
        if error:
          raise APIError(500, error, kind='server_error')
        texts[index], reasons[index], counts[index] = text, reason, count
    finally:
      for job in jobs:
        self.engine.cancel(job)  # a gone client's jobs stop at the next block
    choices = [
      self._choice(kind, i, text, reason, final=True)
      for i, (text, reason) in enumerate(zip(texts, reasons))
    ]
    return {
      'id': rid,
      'object': 'chat.completion' if kind == 'chat' else 'text_completion',
      'created': int(time.time()),
      'model': self.model_name,
      'choices': choices,
      'usage': self.usage(parsed, counts),
    }

  def _choice(self, kind, index, text, reason, *, final=False, first=False):
    if kind == 'chat':
      if final:
        return {
          'index': index,
          'message': {'role': 'assistant', 'content': text},
          'finish_reason': reason,
        }
      delta = {'role': 'assistant', 'content': text} if first else {'content': text}
      return {'index': index, 'delta': delta, 'finish_reason': reason}
    return {'index': index, 'text': text, 'finish_reason': reason, 'logprobs': None}

  async def _events(self, jobs, queue, parsed, kind, rid):
    """A chunk per committed block of each choice: the new text (a stop string's possible
    beginning held back until the text is final), then a last chunk with finish_reason."""
    obj = 'chat.completion.chunk' if kind == 'chat' else 'text_completion'
    sent, reasons, counts = [0] * len(jobs), [None] * len(jobs), [0] * len(jobs)
    hold = max((len(s) for s in parsed.stop), default=1) - 1
    created = int(time.time())

    def event(choice, usage=None):
      body = {'id': rid, 'object': obj, 'created': created, 'model': self.model_name}
      body['choices'] = [choice] if choice else []
      if usage:
        body['usage'] = usage
      return f'data: {json.dumps(body)}\n\n'

    try:
      if kind == 'chat':
        for i in range(len(jobs)):
          yield event(self._choice(kind, i, '', None, first=True))
      while any(r is None for r in reasons):
        index, text, reason, count, error = await queue.get()
        if error:
          yield 'data: ' + json.dumps({'error': {'message': error, 'type': 'server_error'}})
          yield '\n\n'
          break
        counts[index] = count
        end = len(text) if reason else max(sent[index], len(text) - hold)
        if end > sent[index]:
          yield event(self._choice(kind, index, text[sent[index] : end], None))
          sent[index] = end
        if reason:
          reasons[index] = reason
          yield event(self._choice(kind, index, '', reason))
      yield event(None, self.usage(parsed, counts))
      yield 'data: [DONE]\n\n'
    finally:
      for job in jobs:
        self.engine.cancel(job)  # a gone client's jobs stop at the next block


def build(model, defaults, *, model_name, chat_template=None, max_batch=16, max_queue=256,
          buckets=None, prefix_cache=0, blocks_per_call=1):  # fmt: skip
  """(engine, ASGI app) serving a Pretrained model (dlmjax/inference.py); start the engine with
  engine.start(warmup) once the app listens."""
  buckets = buckets or engine_lib.Buckets(batch=(max_batch,), width=(64,))
  batch = tuple(b for b in buckets.batch if b < max_batch) + (max_batch,)
  eng = engine_lib.Engine(
    model,
    max_batch=max_batch,
    max_queue=max_queue,
    buckets=engine_lib.Buckets(batch=batch, width=buckets.width),
    stop_piece=model.tokenizer.piece_id(inference.DIFFUCODER_PAD_PIECE),
    prefix_cache=prefix_cache,
    blocks_per_call=blocks_per_call,
  )
  eng.check(engine_lib.Job(prompt=[0], settings=defaults))
  template = chat_template or model.chat_template
  server = Server(eng, defaults=defaults, model_name=model_name, chat_template=template)
  return eng, make_app(server)


def make_app(server: Server) -> fastapi.FastAPI:
  app = fastapi.FastAPI(title='dlmjax', docs_url=None, redoc_url=None)

  @app.exception_handler(APIError)
  async def _api_error(request, e):
    del request
    return error_response(e)

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def _validation(request, e):
    del request
    return error_response(APIError(400, f'bad request: {e.errors()[0].get("msg")}'))

  @app.exception_handler(404)
  async def _not_found(request, e):
    del e
    return error_response(
      APIError(
        404, f'no route {request.method} {request.url.path}; see GET /v1/models.', code='not_found'
      )  # fmt: skip
    )

  @app.exception_handler(405)
  async def _bad_method(request, e):
    del e
    return error_response(
      APIError(405, f'{request.method} is not allowed on {request.url.path}.', code='bad_method')
    )

  async def body_of(request) -> dict:
    raw = await request.body()
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise APIError(400, f'the body is not valid JSON ({e}); send a JSON object.') from e
    if not isinstance(body, dict):
      raise APIError(400, f'the body must be a JSON object, got {type(body).__name__}.')
    return body

  @app.get('/health')
  async def health():
    stats = server.engine.stats()
    ready = not stats['compiling'] and not stats['draining']
    state = 'compiling' if stats['compiling'] else 'draining' if stats['draining'] else 'ok'
    return responses.JSONResponse({'status': state, **stats}, status_code=200 if ready else 503)

  @app.get('/v1/models')
  async def models():
    return {
      'object': 'list',
      'data': [
        {
          'id': server.model_name,
          'object': 'model',
          'created': server.created,
          'owned_by': 'dlmjax',
        }
      ],  # fmt: skip
    }

  @app.post('/v1/completions')
  async def completions(request: fastapi.Request):
    body = await body_of(request)
    parsed = server.parse(body, server.completion_prompts(body))
    return await server.run(request, parsed, 'text')

  @app.post('/v1/chat/completions')
  async def chat_completions(request: fastapi.Request):
    body = await body_of(request)
    parsed = server.parse(body, server.chat_prompt(body))
    return await server.run(request, parsed, 'chat')

  return app


class DrainingServer(uvicorn.Server):
  """uvicorn's server that starts the engine once listening (compiling `warmup`'s programs
  while /health says so), and on SIGINT / SIGTERM shuts down gracefully: the engine takes no new
  jobs from the signal on, in-flight requests finish. A SIGTERM then exits 0 (uvicorn would
  re-raise it after its shutdown, ending the process by the signal)."""

  def __init__(self, config, eng, warmup=None):
    super().__init__(config)
    self.engine, self.warmup = eng, warmup

  async def startup(self, sockets=None):
    await super().startup(sockets)
    self.engine.start(warmup=self.warmup)

  def handle_exit(self, sig, frame):
    self.engine.stop_taking()
    super().handle_exit(sig, frame)
    if sig == signal.SIGTERM and sig in self._captured_signals:
      self._captured_signals.remove(sig)
