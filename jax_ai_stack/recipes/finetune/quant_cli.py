"""`jax-ai-stack quantize`: post-training quantization of a trained workdir.

    jax-ai-stack quantize --workdir DIR --scheme w8      (w8, w8a8 or w4)
    jax-ai-stack quantize --workdir DIR                  (a QAT run: its own scheme)
    jax-ai-stack quantize --workdir DIR --scheme w8 data.validation_fraction=0.2
    jax-ai-stack eval --workdir DIR --quantized w8
    jax-ai-stack generate --workdir DIR --quantized w8

Example:
  >>> import argparse
  >>> parser = argparse.ArgumentParser(prog="jax-ai-stack")
  >>> register(parser.add_subparsers(dest="command"))
  >>> args = parser.parse_args(["quantize", "--workdir", "runs/lm-tiny", "--scheme", "w4"])
  >>> args.workdir, args.scheme, args.func.__name__
  ('runs/lm-tiny', 'w4', 'run_quantize')
"""

from __future__ import annotations

import argparse
import os

from jax_ai_stack import logs
from jax_ai_stack.errors import DataError
from jax_ai_stack.recipes.cli import EVAL_OVERRIDES_EPILOG, eval_overrides, with_split_hint
from jax_ai_stack.recipes.finetune.config import SCHEMES, check_scheme, describe_schemes

_EPILOG = f"""\
Schemes: {describe_schemes()}.
The token embedding (also the output head), the norms and, except in w8a8,
the CNN's convolutions stay float.

Prints the validation metrics of the run as trained and of the quantized
model, their deltas and the parameter bytes before and after (int4 counted
packed), and saves the quantized parameters in DIR/quantized/SCHEME/STEP/,
which `eval --quantized SCHEME` and `generate --quantized SCHEME` use.

{EVAL_OVERRIDES_EPILOG}
Exit status: 0 quantized; 2 bad input (an unknown scheme, a workdir without
a checkpoint: nothing is written).
"""


def register(subparsers) -> None:
  parser = subparsers.add_parser(
      "quantize", help="quantize a trained workdir (Qwix PTQ) and compare it with float",
      description="Quantize the newest checkpoint in --workdir with Qwix (post-training "
      "quantization), evaluate float vs quantized, and save the quantized parameters. Extra "
      "arguments are dotted data overrides for the evaluation, as `eval` takes them.",
      epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="a workdir `train` wrote")
  parser.add_argument("--scheme", metavar="SCHEME",
                      help=f"one of {', '.join(SCHEMES)} (default: the run's quant.qat)")
  parser.set_defaults(func=run_quantize, accepts_overrides=True)


def run_quantize(args: argparse.Namespace) -> int:
  if args.scheme is not None:
    check_scheme(args.scheme)  # Before jax and the libraries load.
  overrides = eval_overrides(args)
  logs.status(f"quantizing {args.workdir} ...")  # Before jax loads.
  from jax_ai_stack.recipes.finetune import ptq

  try:
    report = ptq.quantize_run(args.workdir, args.scheme, overrides=overrides, environ=os.environ,
                              capture_stderr=True)
  except DataError as e:
    raise with_split_hint(e, args) from None
  if report.trained.startswith("qat") and report.trained != f"qat {report.scheme}":
    logs.note(f"the run trained for {report.trained}; quantized to {report.scheme}, which "
              "QAT did not prepare it for")
  print(f"step {report.step}, scheme {report.scheme} ({SCHEMES[report.scheme]}):")
  print(report.table())
  state = "saved" if report.saved else "already saved (same step, same bits)"
  print(f"{state}: {report.path}")
  return 0
