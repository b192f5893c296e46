"""`jax-ai-stack eval --tasks`: lm-evaluation-harness tasks on a finished run.

`recipes.cli` parses the flags and opens the run; this runs the tasks, writes the
harness's results JSON into the workdir and prints its table.

Example:
  >>> import argparse
  >>> run_harness(argparse.Namespace(batch_size=0), open_run=None)
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.UsageError: --batch-size must be at least 1; got 0
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.errors import UsageError


def run_harness(args: argparse.Namespace, open_run: Callable[[], Any]) -> int:
  """`eval --tasks`: lm-evaluation-harness tasks on the run's model (`open_run()`, the
  command's way of opening it: --quantized too); the results JSON goes to W/eval_harness/,
  the table to stdout."""
  if args.batch_size < 1:
    raise UsageError(f"--batch-size must be at least 1; got {args.batch_size}")
  if args.limit is not None and args.limit <= 0:
    raise UsageError(f"--limit must be above 0; got {args.limit}")
  if args.overrides:
    raise UsageError("--tasks takes no data overrides: the tasks bring their own data")
  from jax_ai_stack.recipes import evaluation

  harness, harness_model = evaluation.harness_modules("eval --tasks")
  entries = [entry.strip() for entry in args.tasks.split(",") if entry.strip()]
  from jax_ai_stack.recipes.evaluation import stdlib_tasks

  with tempfile.TemporaryDirectory() as scratch:  # The embedded tasks, while they run.
    tasks, made = harness.prepare(entries, pathlib.Path(scratch))
    trainer = open_run()  # After the names.
    try:
      model = harness_model.for_run(trainer, batch_size=args.batch_size)
      limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
      with trainer.kernel_configs():
        results = harness.evaluate(model, tasks, limit=limit, num_fewshot=args.num_fewshot,
                                   apply_chat_template=args.apply_chat_template,
                                   seed=trainer.config.train.seed)
    finally:
      trainer.close()
  from lm_eval.utils import handle_non_serializable, make_table

  out = pathlib.Path(args.workdir) / "eval_harness"
  path = out / f"results-step{trainer.step}-{time.strftime('%Y%m%dT%H%M%S')}.json"
  out.mkdir(exist_ok=True)
  write_atomically(path, json.dumps(results, indent=2, default=handle_non_serializable))
  print(make_table(results))
  if (note := harness.stderr_note(results)) is not None:
    print(note, file=sys.stderr)
  if made:  # A copy to read and change: `--tasks W/eval_harness/stdlib_tasks` runs it.
    print(f"tasks {stdlib_tasks.write(out / 'stdlib_tasks', made)}", file=sys.stderr)
  print(f"results {path}", file=sys.stderr)
  return 0
