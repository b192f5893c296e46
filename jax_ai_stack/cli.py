"""The `jax-ai-stack` command.

Each subcommand lives beside the code it drives and registers itself here through
a `register(subparsers)` function that sets `func` on its parser; `func(args)`
returns the exit code. Usage errors exit 2 with one line naming what is wrong.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from jax_ai_stack.errors import UsageError

# Modules that register subcommands, in the order `--help` lists them.
_COMMAND_MODULES = (
    "jax_ai_stack.doctor",
    "jax_ai_stack.recipes.cli",
    "jax_ai_stack.kernels.cli",
)


def build_parser() -> argparse.ArgumentParser:
  from jax_ai_stack import __version__

  parser = argparse.ArgumentParser(
      prog="jax-ai-stack",
      description="A tested, pinned JAX AI stack: check it, pin it, train with it.",
  )
  parser.add_argument("--version", action="version", version=f"jax-ai-stack {__version__}")
  subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
  for module_name in _COMMAND_MODULES:
    importlib.import_module(module_name).register(subparsers)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  if extra and not getattr(args, "accepts_overrides", False):
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  args.overrides = extra
  if not getattr(args, "func", None):
    parser.print_help()
    return 2
  try:
    return args.func(args)
  except UsageError as e:
    print(f"jax-ai-stack {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
