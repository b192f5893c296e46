"""`jax-ai-stack train`, `generate` and `eval`: the recipes from the command line.

    jax-ai-stack train [PRESET] [--config FILE.yaml] [--workdir DIR] [dotted overrides]
    jax-ai-stack train --list
    jax-ai-stack generate --workdir DIR --prompt TEXT
    jax-ai-stack eval --workdir DIR

Overrides take either form: `model.num_layers=6` or `--model.num_layers 6`.
"""

from __future__ import annotations

import argparse
import json

from jax_ai_stack.cli import UsageError


def register(subparsers) -> None:
  train = subparsers.add_parser(
      "train",
      help="train a recipe (default: lm-tiny); run again to resume",
      description="Train a preset recipe. Extra arguments are dotted config overrides "
      "(model.num_layers=6 or --model.num_layers 6).",
  )
  train.add_argument("--list", action="store_true", help="list the presets and exit")
  train.add_argument("--config", help="a YAML file merged over the preset")
  train.add_argument("--workdir", help="where checkpoints and logs go (default: runs/<preset>)")
  train.add_argument("--resume", choices=("auto", "never"), help="override train.resume")
  train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
  train.set_defaults(func=run_train, accepts_overrides=True)

  generate = subparsers.add_parser("generate", help="sample text from a trained LM workdir")
  generate.add_argument("--workdir", required=True)
  generate.add_argument("--prompt", default="def ")
  generate.add_argument("--max-new-tokens", type=int, default=128)
  generate.add_argument("--temperature", type=float, default=0.8)
  generate.set_defaults(func=run_generate)

  evaluate = subparsers.add_parser("eval", help="evaluate a trained workdir on its validation split")
  evaluate.add_argument("--workdir", required=True)
  evaluate.set_defaults(func=run_eval)


def _split_preset(extra: list[str]) -> tuple[str | None, list[str]]:
  """The first bare word (no '=', no leading '--') is the preset; the rest are overrides."""
  if extra and not extra[0].startswith("-") and "=" not in extra[0]:
    return extra[0], extra[1:]
  return None, extra


def _errors():
  """The exceptions that mean bad input: printed as one line, exit 2."""
  from jax_ai_stack import kernels
  from jax_ai_stack.recipes import checkpoint, configlib, train

  return (configlib.ConfigError, checkpoint.CheckpointMismatchError, train.WorkdirError,
          kernels.AutotuneError, FileNotFoundError, ImportError, ValueError)


def run_train(args: argparse.Namespace) -> int:
  from jax_ai_stack.recipes import config as recipe_config
  from jax_ai_stack.recipes import configlib, train

  if args.list:
    for name in recipe_config.list_presets():
      marker = " (default)" if name == recipe_config.DEFAULT_PRESET else ""
      print(f"{name}{marker}")
    return 0
  preset, extra = _split_preset(args.overrides)
  try:
    overrides = configlib.parse_overrides(extra)
    config = recipe_config.load(
        preset or (None if args.config else recipe_config.DEFAULT_PRESET),
        config_file=args.config,
        overrides=overrides,
    )
    if args.print_config:
      print(configlib.to_yaml(config), end="")
      return 0
    train.run(config, args.workdir, resume=args.resume)
  except train.TrainingError as e:
    print(f"jax-ai-stack train: {e}")
    return 1
  except _errors() as e:
    raise UsageError(str(e)) from None
  return 0


def run_generate(args: argparse.Namespace) -> int:
  from jax_ai_stack.recipes import train

  try:
    session = train.open_trained(args.workdir)
    if not session.is_lm:
      raise UsageError(f"{args.workdir} holds a {session.config.model.kind} model, not a language model")
    print(train.sample(session, args.prompt, args.max_new_tokens, args.temperature))
  except _errors() as e:
    raise UsageError(str(e)) from None
  return 0


def run_eval(args: argparse.Namespace) -> int:
  from jax_ai_stack.recipes import train

  try:
    session = train.open_trained(args.workdir)
    metrics = train.evaluate(session)
  except _errors() as e:
    raise UsageError(str(e)) from None
  print(json.dumps({"step": session.start_step, **metrics}, indent=2))
  return 0
