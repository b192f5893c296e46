"""The `jax-ai-stack` command.

Each subcommand lives beside the code it drives and registers itself here through
a `register(subparsers)` function that sets `func` on its parser; `func(args)`
returns the exit code. A `UserError` (bad input: `jax_ai_stack.errors`) prints
one line naming what is wrong and exits 2; Ctrl-C outside a training loop (which
saves first) prints one line and exits 130; any other exception is a bug and
keeps its traceback (exit 1).

Log records go where `logs` says, for the whole command: the libraries'
warnings to the workdir's log file (a command names it with
`args.log_routes.keep_in(...)`), not the console, unless `--verbose`; the C++
libraries' own INFO and WARNING lines (XLA's) follow the same rule (`native_logs`).

Example:
  >>> args = build_parser().parse_args(["constraints", "--python", "3.12"])
  >>> args.command, args.python, args.func.__name__
  ('constraints', '3.12', 'run_constraints')
  >>> main(["constraints", "--python", "3.12", "--accelerator", "tpu"])  # doctest: +ELLIPSIS
  # jax-ai-stack ...: tested set py3.12-tpu (Python 3.12, tpu)
  # Use: pip install -c constraints.txt <your packages>
  ...
  jax==...
  ...
  0
  >>> main(["constraints", "--accelerator", "xpu"])  # One line on stderr names the problem.
  2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading

from jax_ai_stack.errors import UserError  # Imports nothing.

INTERRUPTED_EXIT_CODE = 130  # As shells report SIGINT.

# Modules that register subcommands, in the order `--help` lists them.
_COMMAND_MODULES = (
    "jax_ai_stack.doctor",
    "jax_ai_stack.recipes.cli",
    "jax_ai_stack.recipes.generate_cli",
    "jax_ai_stack.recipes.hf_cli",
    "jax_ai_stack.recipes.serve.cli",
    "jax_ai_stack.recipes.data.cli",
    "jax_ai_stack.recipes.finetune.lora_cli",
    "jax_ai_stack.recipes.finetune.quant_cli",
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
  for command_parser in subparsers.choices.values():
    command_parser.set_defaults(command_parser=command_parser)
  return parser


def _interrupted(command: str) -> str:
  return f"jax-ai-stack{' ' + command if command else ''}: interrupted (Ctrl-C)"


@contextlib.contextmanager
def _ctrl_c_exits(command: str):
  """Ctrl-C ends the command at once: one line, exit 130.

  A KeyboardInterrupt would land wherever Python happens to be, and JAX's
  garbage-collection callback swallows it ("Exception ignored ..."), so the
  command would go on; other places print a long traceback. Ending at once
  loses nothing saved: Orbax steps and `atomic` files are renamed into place
  whole, `data prepare` resumes, and the training loop installs its own
  handler, which saves first.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def stop(signum, frame):
    del signum, frame
    below_a_bar = "\n" if sys.stderr.isatty() else ""  # A progress bar ends in no newline.
    print(below_a_bar + _interrupted(command), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(INTERRUPTED_EXIT_CODE)  # pylint: disable=protected-access

  previous = signal.signal(signal.SIGINT, stop)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
  # Building the parser imports each command's module (jax among them): a Ctrl-C
  # there must end as one anywhere else does. A KeyboardInterrupt raised inside an
  # import can leave CPython marked to kill itself by SIGINT at exit (-2, not 130).
  # `logs` and `native_logs` are imported here, not at the top, for the same reason:
  # `python -m jax_ai_stack.cli` runs this module's imports before any handler.
  with _ctrl_c_exits(next(iter(sys.argv[1:] if argv is None else argv), "")):
    from jax_ai_stack import logs, native_logs  # pylint: disable=import-outside-toplevel
    parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  if extra and not getattr(args, "accepts_overrides", False):
    # The subcommand's own usage, not the top-level one.
    getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
  args.overrides = extra
  if not getattr(args, "func", None):
    parser.print_help()
    return 2
  verbose = getattr(args, "verbose", False)
  with logs.routed(None, verbose=verbose) as routes:
    with native_logs.kept_off_console(enabled=not verbose), _ctrl_c_exits(args.command):
      args.log_routes = routes
      try:
        code = args.func(args)
      except UserError as e:
        print(f"jax-ai-stack {args.command}: error: {e}", file=sys.stderr)
        code = 2
      except KeyboardInterrupt:  # Raised by code, or where `_ctrl_c_exits` cannot listen.
        print(_interrupted(args.command), file=sys.stderr)
        code = INTERRUPTED_EXIT_CODE
    summary = routes.summary()  # Native lines counted too: they are records by now.
    if summary:
      print(summary, file=sys.stderr)
  return code


if __name__ == "__main__":
  sys.exit(main())
