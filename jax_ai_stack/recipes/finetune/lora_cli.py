"""`jax-ai-stack lora merge`: a LoRA run's adapters folded into full weights.

    jax-ai-stack lora merge --workdir runs/lm-tiny-lora [--out runs/lm-tiny-lora-merged]

The output is a normal run workdir (`eval`, `generate` and `train` read it)
that no longer needs the base run. Training a LoRA run is `jax-ai-stack train
lm-tiny-lora` (a recipe with a `finetune.lora` section).

Example:
  >>> import argparse
  >>> parser = argparse.ArgumentParser(prog="jax-ai-stack")
  >>> register(parser.add_subparsers(dest="command"))
  >>> args = parser.parse_args(["lora", "merge", "--workdir", "runs/lm-tiny-lora"])
  >>> args.workdir, args.out, args.func.__name__
  ('runs/lm-tiny-lora', None, 'run_merge')
"""

from __future__ import annotations

import argparse
import os

from jax_ai_stack import logs
from jax_ai_stack.errors import UsageError


def register(subparsers) -> None:
  parser = subparsers.add_parser(
      "lora", help="LoRA fine-tuning runs: merge adapters into full weights",
      description="Work with LoRA fine-tuning runs (train one with a recipe that has finetune.lora).")
  commands = parser.add_subparsers(dest="lora_command", metavar="ACTION")
  merge = commands.add_parser(
      "merge", help="write base + adapters as full weights in a normal run workdir",
      description="Fold a LoRA run's adapters into its base weights (W + alpha/r A B) and write "
                  "them as a normal run workdir, so eval and generate work without the base.")
  merge.add_argument("--workdir", required=True, help="a LoRA run's workdir")
  merge.add_argument("--out", help="the merged run's workdir (default: <workdir>-merged); "
                                   "must not have checkpoints")
  merge.set_defaults(func=run_merge)
  parser.set_defaults(func=_missing_action)


def _missing_action(args: argparse.Namespace) -> int:
  raise UsageError("say what to do: jax-ai-stack lora merge --workdir DIR [--out DIR]")


def run_merge(args: argparse.Namespace) -> int:
  logs.status(f"merging the adapters of {args.workdir} ...")
  from jax_ai_stack.recipes.finetune import lora_merge

  out = lora_merge.merge(args.workdir, args.out, environ=os.environ, capture_stderr=True)
  print(f"merged weights written to {out} (eval: jax-ai-stack eval --workdir {out})")
  return 0
