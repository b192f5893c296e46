"""`jax-ai-stack data prepare`: tokenize a recipe's corpus once into a token cache.

    jax-ai-stack data prepare [PRESET] [--config FILE.yaml] [dotted overrides] --cache DIR
                              [--workers N]

The config is resolved as `train` resolves it (preset, file, overrides); only
its `data` section is used. A run that is killed resumes where it stopped when
started again; a finished cache is left as it is.

Example:
  >>> import argparse
  >>> _ = open("a.txt", "w").write("abc"), open("b.txt", "w").write("hello")
  >>> parser = argparse.ArgumentParser(prog="jax-ai-stack")
  >>> register(parser.add_subparsers(dest="command"))
  >>> args, args.overrides = parser.parse_known_args(
  ...     ["data", "prepare", "--cache", "cache", "--quiet", "data.source=text",
  ...      "data.paths=[a.txt,b.txt]"])
  >>> args.func(args)
  cache: 2 documents, 12 tokens (train with data.cache=cache)
  0
"""

from __future__ import annotations

import argparse
import dataclasses

from jax_ai_stack.errors import UsageError


def register(subparsers) -> None:
  data = subparsers.add_parser("data", help="prepare data: a tokenized cache of a corpus",
                               description="Data commands.")
  commands = data.add_subparsers(dest="data_command", metavar="COMMAND")
  prepare = commands.add_parser(
      "prepare", help="tokenize data.* once into a TensorStore token cache (resumable)",
      description="Tokenize the recipe's corpus into --cache; train with data.cache=DIR. Extra"
      " arguments are dotted config overrides (data.paths=[a.txt] or --data.seq_len 256).")
  prepare.add_argument("--preset", help="the preset to start from (default: lm-tiny)")
  prepare.add_argument("--config", help="a YAML file merged over the preset")
  prepare.add_argument("--cache", help="the cache: a directory or a kvstore URL"
                       " (default: data.cache of the config)")
  prepare.add_argument("--workers", type=_at_least_one, default=1,
                       help="processes that tokenize (default: 1); the cache is the same")
  prepare.add_argument("--quiet", action="store_true", help="no progress bar")
  prepare.set_defaults(func=run_prepare, accepts_overrides=True)
  data.set_defaults(func=lambda args: _help(data))


def _at_least_one(text: str) -> int:
  if not text.isdigit() or int(text) < 1:
    raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
  return int(text)


def _help(parser: argparse.ArgumentParser) -> int:
  parser.print_help()
  return 2


def run_prepare(args: argparse.Namespace) -> int:
  from jax_ai_stack.recipes import cli as recipes_cli
  from jax_ai_stack.recipes.data import token_cache

  data = recipes_cli.load_config(args).data
  if data.mixture is not None:  # Each component with a cache of its own.
    cached = {name: c.cache for name, c in data.mixture.components.items() if c.cache}
    if args.cache or not cached:
      raise UsageError("a mixture's components name their own caches: set "
                       "data.mixture.components.NAME.cache (and no --cache)")
    for name, cache in cached.items():
      manifest = token_cache.prepare(data.component(name), cache, progress=not args.quiet,
                                     workers=args.workers)
      print(f"{cache}: {manifest.num_documents} documents, {manifest.num_tokens} tokens"
            f" (component {name})")
    return 0
  cache = args.cache or data.cache
  if not cache:
    raise UsageError("no cache location: pass --cache DIR (or set data.cache)")
  data = dataclasses.replace(data, cache=cache)
  manifest = token_cache.prepare(data, cache, progress=not args.quiet, workers=args.workers)
  print(f"{cache}: {manifest.num_documents} documents, {manifest.num_tokens} tokens"
        f" (train with data.cache={cache})")
  return 0
