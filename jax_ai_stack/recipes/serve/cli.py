"""`jax-ai-stack serve`: the model trained in a workdir behind an OpenAI-compatible API.

    jax-ai-stack serve --workdir W [--port 8000] [--api-key-file PATH] [--max-slots 8]
                       [--max-pages N]

then any OpenAI client: `openai.OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key=KEY or "unused")`, with `model` the workdir's folder name. The key comes from
--api-key-file (preferred), $JAX_AI_STACK_API_KEY or --api-key (which the process list
shows); /health answers without it. On loopback (the default) only loopback names are
answered in the Host header (--allowed-hosts adds others); elsewhere without a key, a
note says the model is open to the network.

Example: the flags and their defaults.
  >>> import argparse
  >>> commands = argparse.ArgumentParser().add_subparsers()
  >>> register(commands)
  >>> args = commands.choices["serve"].parse_args(["--workdir", "runs/lm-tiny"])
  >>> args.host, args.port, args.max_slots, args.max_queue, args.page_size, args.max_pages
  ('127.0.0.1', 8000, 8, 64, 64, None)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from jax_ai_stack import logs
from jax_ai_stack.errors import DataError, MissingExtraError, UsageError
from jax_ai_stack.recipes.generate_cli import GUESSES
from jax_ai_stack.recipes.serve.guards import DEFAULT_MAX_REQUEST_BYTES, is_loopback
from jax_ai_stack.recipes.serve.openai_api import DEFAULT_MAX_STOP_BYTES

API_KEY_ENV = "JAX_AI_STACK_API_KEY"


def register(subparsers) -> None:
  serve = subparsers.add_parser(
      "serve", help="serve a trained LM workdir over an OpenAI-compatible HTTP API",
      description="Answer /v1/models, /v1/completions and /v1/chat/completions (streamed or "
      "whole) with the model trained in --workdir, through the generation engine; chats use "
      "the run's chat template. /health (requests running, KV cache pages in use, prompt "
      "tokens the prefix cache spared) answers "
      "without the API key. SIGTERM or Ctrl-C: stop taking requests, finish those under "
      "way, exit. Needs the serve extra: pip install 'jax-ai-stack[serve]'.")
  serve.add_argument("--workdir", required=True, help="a workdir `train` wrote")
  serve.add_argument("--host", default="127.0.0.1",
                     help="the address to listen on (default 127.0.0.1: this machine only)")
  serve.add_argument("--port", type=int, default=8000,
                     help="the port (default 8000; 0: a free one, printed)")
  serve.add_argument("--model-name",
                     help="the name clients pass as `model` (default: the workdir's folder name)")
  serve.add_argument("--api-key",
                     help="require 'Authorization: Bearer KEY' on every /v1 request (/health "
                     "answers without it: it tells only the load). Prefer --api-key-file or "
                     f"${API_KEY_ENV}: a key on the command line shows in the process list "
                     f"(default: ${API_KEY_ENV}, else no key)")
  serve.add_argument("--api-key-file", metavar="PATH",
                     help="read the API key from the first line of PATH (the way to prefer)")
  serve.add_argument("--allowed-hosts", metavar="NAMES", default="",
                     help="comma-separated host names to answer in the Host header besides "
                     "loopback ones (localhost, 127.x.x.x, [::1]), which alone a server on "
                     "loopback answers, against DNS rebinding; '*': any (default: none; "
                     "any when --host is not loopback)")
  serve.add_argument("--max-request-bytes", type=int, metavar="BYTES",
                     default=DEFAULT_MAX_REQUEST_BYTES,
                     help="the largest request body; a larger one is answered 413 (default "
                     f"{DEFAULT_MAX_REQUEST_BYTES})")
  serve.add_argument("--max-stop-bytes", type=int, metavar="BYTES",
                     default=DEFAULT_MAX_STOP_BYTES,
                     help="the longest stop string a request may give, in UTF-8 bytes; "
                     f"a longer one is answered 400 (default {DEFAULT_MAX_STOP_BYTES})")
  serve.add_argument("--max-slots", type=int, default=8,
                     help="requests decoded at once (default 8)")
  serve.add_argument("--max-queue", type=int, default=64,
                     help="requests that may wait for a slot; more are answered 429 (default 64)")
  serve.add_argument("--max-len", type=int,
                     help="positions per slot: prompt plus reply (default: the model's "
                     "max_seq_len)")
  serve.add_argument("--page-size", type=int, default=64,
                     help="positions per page of the KV cache (default 64)")
  serve.add_argument("--max-pages", type=int,
                     help="pages in the KV cache's pool, shared by all slots: a request is "
                     "admitted when its prompt plus max_tokens fit in the free pages (default: "
                     "every slot's --max-len)")
  serve.add_argument("--speculate", type=int, metavar="K",
                     help="speculative decoding: each step also checks up to K tokens "
                     "guessed from a request's text so far (prompt lookup), keeping those "
                     "the model would have sampled: the same replies, faster where they "
                     "repeat their prompt; /health gives the share kept")
  serve.add_argument("--draft", metavar="WORKDIR",
                     help="speculative decoding with a draft model: a smaller trained run of "
                     "the same tokenizer guesses the tokens (greedy), with --speculate K of "
                     f"them a step (default {GUESSES})")
  serve.add_argument("--quantized", metavar="SCHEME",
                     help="serve the parameters `quantize --scheme SCHEME` saved in --workdir")
  serve.add_argument("--verbose", action="store_true",
                     help="show the libraries' log lines on the console too")
  serve.set_defaults(func=run_serve)


def api_key(args: argparse.Namespace, environ=os.environ) -> str | None:
  """The key requests must send: --api-key-file's first line, --api-key, or
  $JAX_AI_STACK_API_KEY; None: no key. An empty one is refused (it would open the server
  silently), as are both flags at once."""
  if args.api_key_file is not None and args.api_key is not None:
    raise UsageError("give --api-key or --api-key-file, not both")
  if args.api_key_file is not None:
    try:
      with open(args.api_key_file, encoding="utf-8") as file:
        key = file.readline().strip()
    except (OSError, UnicodeDecodeError) as e:
      raise UsageError(f"--api-key-file {args.api_key_file}: "
                       f"{getattr(e, 'strerror', None) or e}") from None
    if not key:
      raise UsageError(f"--api-key-file {args.api_key_file}: its first line is empty; write "
                       "the key there")
    return key
  if args.api_key is not None:
    if not args.api_key.strip():
      raise UsageError("--api-key is empty: give a key, or leave the flag out to serve "
                       "without one")
    return args.api_key.strip()
  key = environ.get(API_KEY_ENV)
  if key is not None and not key.strip():
    raise UsageError(f"${API_KEY_ENV} is set but empty: give a key, or unset it to serve "
                     "without one")
  return key.strip() if key else None


def allowed_hosts(names: str) -> frozenset[str] | None:
  """The Host names --allowed-hosts adds to loopback ones ("*": any); None: not given
  (`server.serve` then answers loopback names alone on loopback, any name elsewhere)."""
  given = frozenset(name.strip().lower() for name in names.split(",") if name.strip())
  return given or None


def run_serve(args: argparse.Namespace) -> int:
  key, hosts = api_key(args), allowed_hosts(args.allowed_hosts)
  if key is None and not is_loopback(args.host):
    logs.note(f"--host {args.host} is not loopback and no API key is set: anyone who can "
              "reach this machine can use the model (set --api-key-file)")
  for name in ("max_slots", "max_len", "page_size", "max_pages", "max_request_bytes",
               "max_stop_bytes", "speculate"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise UsageError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(args, name)}")
  if args.max_queue < 0:
    raise UsageError(f"--max-queue must be at least 0; got {args.max_queue}")
  if not 0 <= args.port <= 65535:
    raise UsageError(f"--port must be in [0, 65535]; got {args.port}")
  try:
    from jax_ai_stack.recipes.serve import server
  except ImportError as e:
    raise MissingExtraError(f"serve needs the {e.name!r} package: pip install "
                            "'jax-ai-stack[serve]'") from None
  from jax_ai_stack.recipes import compile_cache, data, inference
  from jax_ai_stack.recipes.cli import _check_quantized, _open_finished
  from jax_ai_stack.recipes.generate_cli import speculation

  _check_quantized(args)
  logs.status(f"loading {args.workdir} ...")
  compile_cache.enable()
  run = _open_finished(args, validation=False, method="decode")
  stack = contextlib.ExitStack()  # A draft model's run, open while it serves.
  try:
    task, config = run.task, run.config
    if not hasattr(task, "prompt_encoder"):
      raise UsageError(f"{args.workdir}: a {type(task).__name__} run; serve answers with "
                       "language models only")
    guessing = stack.enter_context(speculation(args, config))
    max_len = args.max_len or config.model.max_seq_len
    if max_len > config.model.max_seq_len:
      raise UsageError(f"--max-len {max_len} is past the model's max_seq_len "
                       f"({config.model.max_seq_len})")
    tokenizer = task.tokenizer()
    try:  # Its tools' syntax; a run without one still serves completions.
      template = data.chat_template.for_data(config.data, tokenizer)
    except DataError:
      template = None
    engine = inference.Engine(run.inference_model(), max_slots=args.max_slots, max_len=max_len,
                              decode=tokenizer.decode, page_size=args.page_size,
                              max_pages=args.max_pages,  # Structured output's:
                              grammar_vocabulary=inference.grammar.vocabulary(tokenizer),
                              speculation=guessing)
    served = server.Served(
        args.model_name or os.path.basename(os.path.abspath(args.workdir)), engine, tokenizer,
        task.prompt_encoder(), api_key=key, max_queue=args.max_queue,
        around=run.kernel_configs, allowed_hosts=hosts,
        max_request_bytes=args.max_request_bytes, max_stop_bytes=args.max_stop_bytes,
        chat_template=template)
    logs.status("compiling the first programs ...")
    with run.kernel_configs():  # The first request then finds them compiled.
      engine.run([inference.Request((int(tokenizer.bos_id) % engine.vocab_size,), 2,
                                    temperature=0)])

    def ready(url: str) -> None:
      key = " (API key required)" if served.api_key else ""
      print(f"serving {served.name!r} at {url}{key}; SIGTERM or Ctrl-C stops it after the "
            "requests under way", flush=True)

    server.serve(served, host=args.host, port=args.port, on_ready=ready)
  finally:
    stack.close()
    run.close()
  print("stopped", file=sys.stderr)
  return 0
