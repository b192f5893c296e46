"""An OpenAI-compatible HTTP server over the generation engine (Starlette on uvicorn).

`build_app(served)` answers `/v1/models` (and `/v1/models/{id}`), `/v1/completions` and
`/v1/chat/completions`, whole or streamed as server-sent events, for the one model in
`served`, and `/health` (requests running, requests cancelled, the KV cache's pages in
use, at peak and in all, and what shared prompts and the prefix cache spared, as the worker
measured them: `EngineWorker.figures`) without a key. A path with a
trailing slash is served as the path (never redirected). Each request's choices become
engine requests (choice i seeded `seed + i`), checked and decoded with every other
client's by one `EngineWorker`; the engine ends each at its stop strings (its text cut
before them) and, for a chat, at the model's end-of-turn token, in the step that made it.
Every error takes OpenAI's shape, with the field named where one is at fault: a bad
request 400, a wrong API key 401, a Host not allowed 403 (`guards`), an unknown model or
route 404, a body past `max_request_bytes` 413, a full queue 429, a stopped engine 503,
anything else 500; a client that goes away has its requests cancelled, so their slots
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
import json
import logging
import secrets
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from jax_ai_stack.errors import DataError, UsageError
from jax_ai_stack.recipes.inference import engine as engine_lib
from jax_ai_stack.recipes.serve import guards, openai_api, replies, tools
from jax_ai_stack.recipes.serve.openai_api import ApiError
from jax_ai_stack.recipes.serve.worker import EngineStopped, EngineWorker, Update

__all__ = ["Served", "build_app", "serve"]

_log = logging.getLogger(__name__)

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
  """When set, every /v1 request must send `Authorization: Bearer <api_key>` (/health
  answers without it: probes read it, and it tells only the load)."""
  max_queue: int = DEFAULT_MAX_QUEUE
  around: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
  """The context the engine's thread runs in (`Run.kernel_configs`)."""
  allowed_hosts: frozenset[str] | None = None
  """The Host names answered besides loopback ones ("*": any; `guards`). None: none when
  `serve` listens on loopback, else (and in `build_app` alone) any."""
  max_request_bytes: int = guards.DEFAULT_MAX_REQUEST_BYTES
  max_stop_bytes: int = openai_api.DEFAULT_MAX_STOP_BYTES
  """The longest stop string a request may give, in UTF-8 bytes."""
  chat_template: object = None
  """The `ChatTemplate` `encode` renders chats with: a request's tools are read in the syntax
  it teaches (`tools.ToolSyntax`). None: requests with tools are refused."""

  def __post_init__(self):
    if self.engine.detokenize is None:
      raise ValueError("Served needs an engine given `decode` (the tokenizer's): replies' "
                       "text and their stop strings come from the engine")
    if self.api_key is not None and not self.api_key.strip():
      raise ValueError("api_key must not be empty (None serves without a key)")


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
        guards.authorize(request.headers.get("authorization"), served.api_key)
        return await handler(request, state["worker"])
      except Exception as e:  # pylint: disable=broad-except
        return _error(_api_error(e))
    return endpoint

  async def models(request, worker):
    del worker
    wanted = request.path_params.get("model_id", "")
    if not wanted:
      return JSONResponse({"object": "list", "data": [_model_card(served.name, state)]})
    if wanted != served.name:
      raise ApiError(f"The model '{wanted}' does not exist; this server serves "
                     f"'{served.name}'", "model", status=404, code="model_not_found")
    return JSONResponse(_model_card(served.name, state))

  async def health(request):
    del request
    worker = state["worker"]
    return JSONResponse({"status": "stopped" if worker.stopped else "ok", **worker.figures()},
                        status_code=503 if worker.stopped else 200)

  async def completions(request, worker):
    ask = openai_api.parse_completion(
        await _body(request, served), max_top_logprobs=served.engine.max_top_logprobs,
        vocab_size=served.engine.vocab_size, max_stop_bytes=served.max_stop_bytes)
    return await _answer(request, worker, served, ask, chat=False)

  async def chat_completions(request, worker):
    ask = openai_api.parse_chat(await _body(request, served),
                                max_top_logprobs=served.engine.max_top_logprobs,
                                max_stop_bytes=served.max_stop_bytes)
    return await _answer(request, worker, served, ask, chat=True)

  async def http_error(request, error: HTTPException):
    del request
    return _error(ApiError(error.detail, status=error.status_code,
                           code="not_found" if error.status_code == 404 else None))

  async def server_error(request, error: Exception):
    del request
    return _error(_api_error(error))

  routes = []
  for path, endpoint, methods in [
      ("/health", health, ["GET"]), ("/v1/models", checked(models), ["GET"]),
      ("/v1/models/{model_id:path}", checked(models), ["GET"]),
      ("/v1/completions", checked(completions), ["POST"]),
      ("/v1/chat/completions", checked(chat_completions), ["POST"])]:
    routes.append(Route(path, endpoint, methods=methods))
    if not path.endswith("}"):
      routes.append(Route(path + "/", endpoint, methods=methods))  # Served, not redirected.
  middleware = ([] if served.allowed_hosts is None else
                [Middleware(guards.HostGuard, allowed=served.allowed_hosts)])
  app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                  exception_handlers={HTTPException: http_error, Exception: server_error})
  app.router.redirect_slashes = False  # Its redirects are built from the Host header.
  return app


def _error(error: ApiError) -> JSONResponse:
  return JSONResponse(openai_api.error_body(error), status_code=error.status)


def _api_error(error: Exception, *, chat: bool = False) -> ApiError:
  """The error a client is sent for `error`, raised while answering it."""
  if isinstance(error, ApiError):
    return error
  if isinstance(error, EngineStopped):
    return ApiError(str(error), status=503, kind="server_error", code="engine_stopped")
  if isinstance(error, engine_lib.RequestError):  # Found by the engine's check.
    field = {"prompt": "messages" if chat else "prompt", "top_logprobs": "top_logprobs"
             if chat else "logprobs", "stop_ids": "stop", "grammar": "response_format"
             }.get(error.field, error.field)
    return ApiError(str(error).split(": ", 1)[-1], field)
  if isinstance(error, DataError):  # The chat template refused the conversation.
    return ApiError(str(error), "messages")
  _log.error("a request failed", exc_info=error)
  return ApiError(f"the server failed to answer: {type(error).__name__}", status=500,
                  kind="server_error", code="internal_error")


async def _body(request: HttpRequest, served: Served):
  return openai_api.parse_json(await guards.read_body(request, served.max_request_bytes))


def _model_card(name: str, state: dict) -> dict:
  return {"id": name, "object": "model", "created": state["created"], "owned_by": "jax-ai-stack"}


async def _answer(request: HttpRequest, worker: EngineWorker, served: Served,
                  ask: openai_api.Ask, *, chat: bool):
  """The reply to a checked request: its choices queued in the engine, then streamed or
  gathered whole."""
  if ask.model != served.name:
    raise ApiError(f"The model '{ask.model}' does not exist; this server serves "
                   f"'{served.name}'", "model", status=404, code="model_not_found")
  syntax = _tool_syntax(served, ask)
  reply_start = syntax.reply_start(ask.tool_choice) if syntax else ""
  items = ([{"messages": list(ask.messages), **({"tools": list(ask.tools), "reply_start":
                                                  reply_start} if ask.tools else {})}] if chat
           else [{"ids": p} if isinstance(p, tuple) else {"prompt": p} for p in ask.prompts])
  wanted, room = len(items) * ask.n, served.engine.max_slots + served.max_queue
  if wanted > room:  # Before any prompt is encoded on the event loop.
    raise ApiError(f"the request asks for {wanted} completions ({len(items)} prompts x n="
                   f"{ask.n}); this server takes at most {room} at once (--max-slots plus "
                   "--max-queue)", "prompt" if len(items) > 1 else "n")
  _check_room(worker, wanted, room)
  # Off the event loop: a long prompt's tokenizing must not hold up the other streams.
  rule = ask.grammar or (syntax.grammar(ask.tool_choice, ask.tools) if syntax else None)
  requests, prompt_tokens = await asyncio.to_thread(_requests, served, ask, items, rule,
                                                    chat=chat)
  _check_room(worker, wanted, room)  # Again: others may have come in meanwhile.
  jobs = worker.submit_all(requests)  # Checked on the engine's thread: all or none.
  try:
    await jobs[0].queued()
  except asyncio.CancelledError:  # The handler was cancelled: its jobs must not run on.
    for job in jobs:
      worker.cancel(job)
    raise
  except Exception as e:  # pylint: disable=broad-except
    raise _api_error(e, chat=chat) from None
  choices = [replies.Choice(number, job) for number, job in enumerate(jobs)]
  reply = replies.Reply(ask, served, chat, prompt_tokens, tools=syntax,
                        reply_start=reply_start)
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
  try:
    return JSONResponse(gathered.result())
  except Exception as e:  # pylint: disable=broad-except
    raise _api_error(e, chat=chat) from None


def _tool_syntax(served: Served, ask: openai_api.Ask) -> tools.ToolSyntax | None:
  """How the reply's tool calls are written, where a chat offers tools and reads calls."""
  if not ask.tools:
    return None
  if served.chat_template is None:
    raise ApiError("this server has no chat template to show tools with: ask without "
                   "'tools'", "tools")
  syntax = tools.ToolSyntax.of(served.chat_template.source, served.chat_template.origin)
  return None if ask.tool_choice == "none" else syntax


def _check_room(worker: EngineWorker, wanted: int, room: int) -> None:
  if worker.running + wanted > room:
    raise ApiError(f"the server is busy: {worker.running} requests are queued or running; "
                   "retry later", status=429, code="rate_limit_exceeded", kind="rate_limit_error")


def _requests(served: Served, ask: openai_api.Ask, items: list[dict], grammar: str | None, *,
              chat: bool) -> tuple[list[engine_lib.Request], int]:
  """Engine requests for `items` x `ask.n` (the engine's thread checks them), each following
  `grammar`, and the prompt tokens counted once per item."""
  engine, seed = served.engine, ask.seed if ask.seed is not None else secrets.randbelow(2**31)
  requests, prompt_tokens = [], 0
  for item in items:
    if "ids" in item:  # Token ids end where a text prompt's reply does: the model's end ids.
      ids, stop_ids = item["ids"], served.encode({"prompt": ""})[1]
    else:  # A prompt: the model's end-of-sequence ids (`generate`'s, the export's); a chat:
      ids, stop_ids = served.encode(item)  # its end of turn.
    prompt_tokens += len(ids)
    room = engine.max_len - len(ids)
    if room < 1:
      raise ApiError(f"the {'conversation' if chat else 'prompt'} is {len(ids)} tokens; the "
                     f"context holds {engine.max_len}", "messages" if chat else "prompt")
    for _ in range(ask.n):
      requests.append(engine_lib.Request(
          tuple(int(t) for t in ids), ask.max_tokens or room, temperature=ask.temperature,
          top_k=ask.top_k, top_p=ask.top_p, seed=(seed + len(requests)) % 2**32,
          stop_ids=stop_ids, top_logprobs=ask.top_logprobs, stop=ask.stop,
          logit_bias=ask.logit_bias, grammar=grammar))
  return requests, prompt_tokens


async def _updates(worker: EngineWorker, choices: Sequence[replies.Choice]
                   ) -> AsyncIterator[tuple[replies.Choice, Update]]:
  """Each choice's updates as they come, merged; on leaving early (a client gone, an
  error) the choices still running are cancelled in the engine."""
  merged: asyncio.Queue = asyncio.Queue()

  async def pump(choice: replies.Choice):
    try:
      async for update in choice.job.updates():
        await merged.put((choice, update))
    except Exception as e:  # pylint: disable=broad-except  # Whatever ended it, told.
      await merged.put((choice, e))

  pumps = [asyncio.ensure_future(pump(choice)) for choice in choices]
  running = {choice.index for choice in choices}
  try:
    while running:
      choice, update = await merged.get()
      if isinstance(update, Exception):
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


async def _gathered(worker: EngineWorker, choices: list[replies.Choice],
                    reply: replies.Reply) -> dict:
  parts: dict[int, list[dict]] = {choice.index: [] for choice in choices}
  async for choice, update in _updates(worker, choices):
    _, logprobs, _ = reply.take(choice, update)
    if logprobs is not None:
      parts[choice.index].append(logprobs)
  return reply.whole(choices, parts)


async def _streamed(worker: EngineWorker, choices: list[replies.Choice], reply: replies.Reply
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
  except Exception as e:  # pylint: disable=broad-except
    yield _event(openai_api.error_body(_api_error(e, chat=reply.chat)))
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
  if served.allowed_hosts is None and guards.is_loopback(host):  # Against DNS rebinding.
    served = dataclasses.replace(served, allowed_hosts=frozenset())
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
