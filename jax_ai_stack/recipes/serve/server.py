"""An OpenAI-compatible HTTP server over the generation engine (Starlette on uvicorn).

`build_app(served)` answers `/v1/models`, `/v1/completions` and `/v1/chat/completions`,
whole or streamed as server-sent events, for the one model in `served`, and `/health`
(requests running, requests cancelled, the KV cache's pages in use, at peak and in all)
without a key. Each request's choices become
engine requests (choice i seeded `seed + i`), decoded with every other client's by one
`EngineWorker`; the engine ends each at its stop strings (its text cut before them) and,
for a chat, at the model's end-of-turn token, in the step that made it. Errors take
OpenAI's shape with the field named: a bad
request 400, a wrong API key 401, an unknown model or route 404, a full queue 429, a
stopped engine 503; a client that goes away has its requests cancelled, so their slots
free at once. `serve` runs the app until SIGTERM or Ctrl-C, which stop taking
connections and finish the requests under way first.

Example (in-process, without a socket):
  >>> from starlette.testclient import TestClient
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import data, inference, models
  >>> model = models.Decoder(models.DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  >>> tokenizer = data.ByteTokenizer()
  >>> engine = inference.Engine(model, max_slots=2, decode=tokenizer.decode)
  >>> served = Served("tiny", engine, tokenizer,
  ...                 lambda item: (tokenizer.encode(item["prompt"]), (tokenizer.eos_id,)))
  >>> with TestClient(build_app(served)) as client:
  ...   reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi",
  ...                                                "max_tokens": 4, "temperature": 0})
  >>> reply.status_code, reply.json()["usage"]
  (200, {'prompt_tokens': 2, 'completion_tokens': 4, 'total_tokens': 6})
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import secrets
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jax_ai_stack.errors import UsageError
from jax_ai_stack.recipes.inference import engine as engine_lib
from jax_ai_stack.recipes.serve import openai_api
from jax_ai_stack.recipes.serve.openai_api import ApiError
from jax_ai_stack.recipes.serve.worker import EngineStopped, EngineWorker, Job, Update

__all__ = ["Served", "build_app", "serve"]

DEFAULT_MAX_QUEUE = 64
"""Requests that may wait for a slot beyond those decoding; more are answered 429."""


@dataclasses.dataclass
class Served:
  """The model a server answers for, and what turns text into its requests."""

  name: str
  """What clients pass as `model` (and /v1/models lists)."""
  engine: engine_lib.Engine
  """Given the tokenizer's `decode`: it gives each reply's text and ends it at a stop string."""
  tokenizer: object
  """A `data.Tokenizer`: its `decode` of each token gives the log-probs' text."""
  encode: Callable[[dict], tuple[np.ndarray, tuple[int, ...]]]
  """{"prompt": text} or {"messages": [...]} -> (prompt ids, ids that end the reply)."""
  api_key: str | None = None
  """When set, requests must send `Authorization: Bearer <api_key>`."""
  max_queue: int = DEFAULT_MAX_QUEUE
  around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
  """The context the engine's thread runs in (`Run.kernel_configs`)."""

  def __post_init__(self):
    if self.engine.detokenize is None:
      raise ValueError("Served needs an engine given `decode` (the tokenizer's): replies' "
                       "text and their stop strings come from the engine")


def build_app(served: Served) -> Starlette:
  """The Starlette application serving `served` (see the module)."""
  state: dict = {}

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    state["worker"] = EngineWorker(served.engine, served.around)
    state["created"] = int(time.time())
    try:
      yield
    finally:
      state.pop("worker").stop()

  def checked(handler):
    async def endpoint(request: HttpRequest):
      try:
        _authorize(request, served.api_key)
        return await handler(request, state["worker"])
      except ApiError as e:
        return _error(e)
      except EngineStopped as e:
        return _error(ApiError(str(e), status=503, kind="server_error", code="engine_stopped"))
    return endpoint

  async def models(request, worker):
    del request, worker
    return JSONResponse({"object": "list", "data": [_model_card(served.name, state)]})

  async def health(request):
    del request
    worker = state["worker"]
    engine = served.engine
    return JSONResponse({"status": "ok", "running": worker.running,
                         "cancelled": worker.cancelled, "pages_in_use": engine.pages_in_use,
                         "peak_pages": engine.peak_pages, "max_pages": engine.max_pages})

  async def completions(request, worker):
    ask = openai_api.parse_completion(await _body(request),
                                      max_top_logprobs=served.engine.max_top_logprobs)
    return await _answer(request, worker, served, ask, chat=False)

  async def chat_completions(request, worker):
    ask = openai_api.parse_chat(await _body(request),
                                max_top_logprobs=served.engine.max_top_logprobs)
    return await _answer(request, worker, served, ask, chat=True)

  async def http_error(request, error: HTTPException):
    del request
    return _error(ApiError(error.detail, status=error.status_code,
                           code="not_found" if error.status_code == 404 else None))

  routes = [Route("/health", health, methods=["GET"]),
            Route("/v1/models", checked(models), methods=["GET"]),
            Route("/v1/completions", checked(completions), methods=["POST"]),
            Route("/v1/chat/completions", checked(chat_completions), methods=["POST"])]
  return Starlette(routes=routes, lifespan=lifespan,
                   exception_handlers={HTTPException: http_error})


def _error(error: ApiError) -> JSONResponse:
  return JSONResponse(openai_api.error_body(error), status_code=error.status)


def _authorize(request: HttpRequest, api_key: str | None) -> None:
  if api_key is None:
    return
  given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
  if not hmac.compare_digest(given.encode(), api_key.encode()):
    raise ApiError("Incorrect API key provided: send 'Authorization: Bearer <key>' with the "
                   "key the server was started with", status=401, code="invalid_api_key")


async def _body(request: HttpRequest):
  try:
    return json.loads(await request.body())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ApiError(f"the request body is not valid JSON: {e}") from None


def _model_card(name: str, state: dict) -> dict:
  return {"id": name, "object": "model", "created": state["created"], "owned_by": "jax-ai-stack"}


@dataclasses.dataclass
class _Choice:
  """One choice of a request: its engine job and the text sent so far."""

  index: int
  job: Job
  text: str = ""
  tokens: int = 0
  finish_reason: str = ""


async def _answer(request: HttpRequest, worker: EngineWorker, served: Served,
                  ask: openai_api.Ask, *, chat: bool):
  """The reply to a checked request: its choices queued in the engine, then streamed or
  gathered whole."""
  if ask.model != served.name:
    raise ApiError(f"The model '{ask.model}' does not exist; this server serves "
                   f"'{served.name}'", "model", status=404, code="model_not_found")
  items = [{"messages": list(ask.messages)}] if chat else [{"prompt": p} for p in ask.prompts]
  requests, prompt_tokens = _requests(served, ask, items, chat=chat)
  if worker.running + len(requests) > served.engine.max_slots + served.max_queue:
    raise ApiError(f"the server is busy: {worker.running} requests are queued or running; "
                   "retry later", status=429, code="rate_limit_exceeded", kind="rate_limit_error")
  choices = [_Choice(number, worker.submit(req)) for number, req in enumerate(requests)]
  reply = _Reply(ask, served, chat, prompt_tokens)
  if ask.stream:
    return StreamingResponse(_streamed(worker, choices, reply), media_type="text/event-stream")
  gathered = asyncio.ensure_future(_gathered(worker, choices, reply))
  gone = asyncio.ensure_future(_disconnected(request))
  await asyncio.wait([gathered, gone], return_when=asyncio.FIRST_COMPLETED)
  if not gathered.done():  # The client went away: `_gathered` cancels its jobs.
    gathered.cancel()
    with contextlib.suppress(asyncio.CancelledError):
      await gathered
    return JSONResponse({}, status_code=499)
  gone.cancel()
  return JSONResponse(gathered.result())


def _requests(served: Served, ask: openai_api.Ask, items: list[dict], *, chat: bool
              ) -> tuple[list[engine_lib.Request], int]:
  """Engine requests for `items` x `ask.n` (checked: ApiError naming the field), and the
  prompt tokens counted once per item."""
  engine, seed = served.engine, ask.seed if ask.seed is not None else secrets.randbelow(2**31)
  requests, prompt_tokens = [], 0
  for item in items:
    ids, stop_ids = served.encode(item)
    if not chat:
      stop_ids = tuple(i for i in (served.tokenizer.eos_id,) if i < engine.vocab_size)
    prompt_tokens += len(ids)
    room = engine.max_len - len(ids)
    if room < 1:
      raise ApiError(f"the {'conversation' if chat else 'prompt'} is {len(ids)} tokens; the "
                     f"context holds {engine.max_len}", "messages" if chat else "prompt")
    for number in range(ask.n):
      request = engine_lib.Request(
          tuple(int(t) for t in ids), ask.max_tokens or room, temperature=ask.temperature,
          top_k=ask.top_k, top_p=ask.top_p, seed=(seed + len(requests)) % 2**32,
          stop_ids=stop_ids, top_logprobs=ask.top_logprobs, stop=ask.stop)
      try:
        engine.check(request, number)
      except engine_lib.RequestError as e:
        field = {"prompt": "messages" if chat else "prompt", "top_logprobs": "top_logprobs"
                 if chat else "logprobs", "stop_ids": "stop"}.get(e.field, e.field)
        raise ApiError(str(e).split(": ", 1)[1], field) from None
      requests.append(request)
  return requests, prompt_tokens


async def _updates(worker: EngineWorker, choices: Sequence[_Choice]
                   ) -> AsyncIterator[tuple[_Choice, Update]]:
  """Each choice's updates as they come, merged; on leaving early (a client gone, an
  error) the choices still running are cancelled in the engine."""
  merged: asyncio.Queue = asyncio.Queue()

  async def pump(choice: _Choice):
    try:
      async for update in choice.job.updates():
        await merged.put((choice, update))
    except EngineStopped as e:
      await merged.put((choice, e))

  pumps = [asyncio.ensure_future(pump(choice)) for choice in choices]
  running = {choice.index for choice in choices}
  try:
    while running:
      choice, update = await merged.get()
      if isinstance(update, EngineStopped):
        raise update
      yield choice, update
      if update.finish_reason:
        running.discard(choice.index)
  finally:
    for task in pumps:
      task.cancel()
    for choice in choices:
      if not choice.finish_reason:
        worker.cancel(choice.job)


class _Reply:
  """Turns updates into OpenAI's reply objects, whole or as chunks."""

  def __init__(self, ask: openai_api.Ask, served: Served, chat: bool, prompt_tokens: int):
    self.ask, self.served, self.chat, self.prompt_tokens = ask, served, chat, prompt_tokens
    self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    self.created = int(time.time())

  def take(self, choice: _Choice, update: Update
           ) -> tuple[str, dict | None, str]:
    """The new text of `choice` after `update`, its log-probs part, and its finish reason
    ("" while it runs)."""
    before = len(choice.text)
    choice.text += update.text
    choice.tokens += len(update.tokens)
    choice.finish_reason = update.finish_reason
    return update.text, self._logprobs(update, before), choice.finish_reason

  def _logprobs(self, update: Update, offset: int) -> dict | None:
    if not self.ask.logprobs:
      return None
    token_text = lambda token: self.served.tokenizer.decode([token])
    texts = [token_text(t) for t in update.tokens]
    top = [[(token_text(t), v) for t, v in row] for row in update.top_logprobs]
    if self.chat:
      return openai_api.chat_logprobs(texts, update.logprobs, top)
    return openai_api.completion_logprobs(texts, update.logprobs, top, offset)

  def whole(self, choices: Sequence[_Choice], parts: dict[int, list[dict]]) -> dict:
    """The non-streamed reply, `parts` each choice's log-probs parts in order."""
    out = []
    for choice in choices:
      logprobs = _joined(parts[choice.index], self.chat) if self.ask.logprobs else None
      if self.chat:
        out.append({"index": choice.index, "finish_reason": choice.finish_reason,
                    "message": {"role": "assistant", "content": choice.text},
                    "logprobs": logprobs})
      else:
        out.append({"index": choice.index, "finish_reason": choice.finish_reason,
                    "text": choice.text, "logprobs": logprobs})
    return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created, "model": self.served.name, "choices": out,
            "usage": self._usage(choices)}

  def chunk(self, choice: _Choice, text: str, logprobs: dict | None, finish: str,
            first: bool) -> dict:
    """One streamed chunk for `choice`."""
    if self.chat:
      delta = {"role": "assistant", "content": text} if first else {"content": text}
      entry = {"index": choice.index, "delta": delta, "logprobs": logprobs,
               "finish_reason": finish or None}
    else:
      entry = {"index": choice.index, "text": text, "logprobs": logprobs,
               "finish_reason": finish or None}
    return self._chunk([entry])

  def usage_chunk(self, choices: Sequence[_Choice]) -> dict:
    return {**self._chunk([]), "usage": self._usage(choices)}

  def _chunk(self, entries: list[dict]) -> dict:
    return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.served.name, "choices": entries}

  def _usage(self, choices: Sequence[_Choice]) -> dict:
    return openai_api.usage(self.prompt_tokens, sum(choice.tokens for choice in choices))


def _joined(parts: list[dict], chat: bool) -> dict:
  """Log-probs parts of one choice as one object."""
  if chat:
    return {"content": [entry for part in parts for entry in part["content"]]}
  joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
  for part in parts:
    for key in joined:
      joined[key] += part[key] or []
  return joined


async def _gathered(worker: EngineWorker, choices: list[_Choice], reply: _Reply) -> dict:
  parts: dict[int, list[dict]] = {choice.index: [] for choice in choices}
  async for choice, update in _updates(worker, choices):
    _, logprobs, _ = reply.take(choice, update)
    if logprobs is not None:
      parts[choice.index].append(logprobs)
  return reply.whole(choices, parts)


async def _streamed(worker: EngineWorker, choices: list[_Choice], reply: _Reply
                    ) -> AsyncIterator[str]:
  """Server-sent events: a chunk per choice per step that added text, then [DONE]."""
  first = {choice.index for choice in choices}
  try:
    async for choice, update in _updates(worker, choices):
      text, logprobs, finish = reply.take(choice, update)
      if text or finish or logprobs or choice.index in first:
        yield _event(reply.chunk(choice, text, logprobs, finish, choice.index in first))
        first.discard(choice.index)
    if reply.ask.include_usage:
      yield _event(reply.usage_chunk(choices))
  except EngineStopped as e:
    yield _event(openai_api.error_body(ApiError(str(e), status=503, kind="server_error")))
  yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
  return f"data: {json.dumps(payload)}\n\n"


async def _disconnected(request: HttpRequest) -> None:
  """Returns when the client closes its connection (the body has been read by then)."""
  while (await request.receive())["type"] != "http.disconnect":
    pass


def serve(served: Served, *, host: str, port: int,
          on_ready: Callable[[str], None] = print) -> None:
  """Serves `served` at http://host:port until SIGTERM or Ctrl-C (then the requests under
  way finish first); `on_ready` gets the base URL once the socket listens (port 0: a free
  one is chosen)."""
  import uvicorn

  class Server(uvicorn.Server):
    """uvicorn's server, but a signal it drained for is not raised again afterwards (the
    command then exits 0, as a stop it was asked for)."""

    @contextlib.contextmanager
    def capture_signals(self):
      previous = {sig: signal.signal(sig, self.handle_exit)
                  for sig in (signal.SIGINT, signal.SIGTERM)}
      try:
        yield
      finally:
        for sig, handler in previous.items():
          signal.signal(sig, handler)

  listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    listener.bind((host, port))
  except OSError as e:
    listener.close()
    raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
  config = uvicorn.Config(build_app(served), log_level="warning", access_log=False,
                          timeout_graceful_shutdown=None)
  server = Server(config)
  bound = listener.getsockname()[1]
  shown = f"[{host}]" if ":" in host else host

  async def run():
    task = asyncio.ensure_future(server.serve(sockets=[listener]))
    while not server.started and not task.done():
      await asyncio.sleep(0.05)
    if server.started:
      on_ready(f"http://{shown}:{bound}/v1")
    await task

  asyncio.run(run())
