"""`jax-ai-stack serve`: the model trained in a workdir behind an OpenAI-compatible API.

    jax-ai-stack serve --workdir W [--port 8000] [--api-key KEY] [--max-slots 8]
                       [--max-pages N]

then any OpenAI client: `openai.OpenAI(base_url="http://127.0.0.1:8000/v1",
api_key=KEY or "unused")`, with `model` the workdir's folder name.

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
import os
import sys

from jax_ai_stack import logs
from jax_ai_stack.errors import MissingExtraError, UsageError

API_KEY_ENV = "JAX_AI_STACK_API_KEY"


def register(subparsers) -> None:
  serve = subparsers.add_parser(
      "serve", help="serve a trained LM workdir over an OpenAI-compatible HTTP API",
      description="Answer /v1/models, /v1/completions and /v1/chat/completions (streamed or "
      "whole) with the model trained in --workdir, through the generation engine; chats use "
      "the run's chat template. SIGTERM or Ctrl-C: stop taking requests, finish those under "
      "way, exit. Needs the serve extra: pip install 'jax-ai-stack[serve]'.")
  serve.add_argument("--workdir", required=True, help="a workdir `train` wrote")
  serve.add_argument("--host", default="127.0.0.1",
                     help="the address to listen on (default 127.0.0.1: this machine only)")
  serve.add_argument("--port", type=int, default=8000,
                     help="the port (default 8000; 0: a free one, printed)")
  serve.add_argument("--model-name",
                     help="the name clients pass as `model` (default: the workdir's folder name)")
  serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                     help="require 'Authorization: Bearer KEY' on every request (default: "
                     f"${API_KEY_ENV}, else no key)")
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
  serve.add_argument("--quantized", metavar="SCHEME",
                     help="serve the parameters `quantize --scheme SCHEME` saved in --workdir")
  serve.add_argument("--verbose", action="store_true",
                     help="show the libraries' log lines on the console too")
  serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
  for name in ("max_slots", "max_len", "page_size", "max_pages"):
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
  from jax_ai_stack.recipes import compile_cache, inference
  from jax_ai_stack.recipes.cli import _check_quantized, _open_finished

  _check_quantized(args)
  logs.status(f"loading {args.workdir} ...")
  compile_cache.enable()
  run = _open_finished(args, validation=False, method="decode")
  try:
    task, config = run.task, run.config
    if not hasattr(task, "prompt_encoder"):
      raise UsageError(f"{args.workdir}: a {type(task).__name__} run; serve answers with "
                       "language models only")
    max_len = args.max_len or config.model.max_seq_len
    if max_len > config.model.max_seq_len:
      raise UsageError(f"--max-len {max_len} is past the model's max_seq_len "
                       f"({config.model.max_seq_len})")
    tokenizer = task.tokenizer()
    engine = inference.Engine(run.inference_model(), max_slots=args.max_slots, max_len=max_len,
                              decode=tokenizer.decode, page_size=args.page_size,
                              max_pages=args.max_pages)
    served = server.Served(
        args.model_name or os.path.basename(os.path.abspath(args.workdir)), engine, tokenizer,
        task.prompt_encoder(), api_key=args.api_key or None, max_queue=args.max_queue,
        around=run.kernel_configs)
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
    run.close()
  print("stopped", file=sys.stderr)
  return 0
