"""The train command's course: a recipe config in, a trained, checkpointed, resumable run out.

`run(config, workdir)` checks what needs no model (`preflight`), opens the
workdir (restoring its newest checkpoint, or starting from the seed), prints
what it runs on, trains it (`trainer.Trainer.fit`: one jitted step per batch,
evaluations, saves, a stop on SIGTERM or SIGINT), then writes `loss.png` and
the Task's artefacts (a text sample for language models) and prints a summary.

What differs between model families is the `Task` (`recipes.tasks`); nothing
here branches on the model kind. `recipes.run.build_run` is the one way into a
workdir: `run` trains what it opens; `eval`/`generate` open a finished run
read-only through it. `Trainer` (re-exported here) opens one in a notebook.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> cfg = config.load("lm-tiny", overrides=["train.steps=2", "model.num_layers=1"])
  >>> run(cfg, "/tmp/doctest-run")["step"]  # doctest: +SKIP
  2
"""

from __future__ import annotations

import logging
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jax_ai_stack import determinism
from jax_ai_stack.errors import WorkdirError
from jax_ai_stack.recipes import compile_cache, distributed, preflight, progress, record
from jax_ai_stack.recipes.config import RecipeConfig
from jax_ai_stack.recipes.metrics import (METRICS_FILE, PLOT_FILE, eval_change, format_metrics,
                                          read_metrics)
from jax_ai_stack.recipes.run import TaskArg, build_run
from jax_ai_stack.recipes.trainer import Trainer, TrainingError
from jax_ai_stack.recipes.workdir import (CHECKPOINT_DIR, default_workdir, prepare_workdir,
                                          write_config)

log = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_DIR", "METRICS_FILE", "PLOT_FILE", "Trainer", "TrainingError",
    "WorkdirError", "default_workdir", "prepare_workdir", "read_metrics", "run",
]


def run(
    config: RecipeConfig,
    workdir: str | pathlib.Path | None = None,
    *,
    task: TaskArg = None,
    resume: str | None = None,
    stop_after: int | None = None,
    verbose: bool = False,
    import_s: float | None = None,
    on_open: Callable[[], None] | None = None,
    environ: Mapping[str, str] | None = None,
    capture_stderr: bool = False,
) -> dict[str, Any]:
  """Trains `config` in `workdir` (default runs/<name>); returns the final metrics.

  A finished run (rerun) does nothing but make sure its artefacts exist.
  `stop_after` stops (and saves) after that step as a preemption would; the
  next call resumes from there. The result's `stopped_by` names what stopped
  the run early ("SIGTERM", "SIGINT", "stop_after=N", "preemption") or is None.
  `verbose` prints one start-up line after the first step: `import_s` (the
  caller's import of the libraries), init, trace and compile seconds, cache hits.
  `on_open` is called once the workdir is open (bad input refused, checkpoint read).
  `environ`: where `JAX_AI_STACK_ATTENTION` is read (the command line passes
  its environment); None: the process's. `capture_stderr` is `build_run`'s.
  """
  workdir = default_workdir(config, workdir)
  harness_tasks = preflight.check(config, workdir)  # Before anything is built or written.
  print(f"recipe {config.name}: preparing data and model in {workdir} ...", flush=True)
  started = time.perf_counter()
  # Says each long trace and compile as it goes, the whole run long (eval, sample too).
  compile_times = compile_cache.CompileTimes(announce=progress.Wait).start()
  try:
    with progress.waiting("preparing data and model", said=True):
      trainer = Trainer.of(build_run(config, workdir, mode="train", task=task,
                                     resume=resume or config.train.resume, environ=environ,
                                     capture_stderr=capture_stderr))
  except BaseException:
    compile_times.stop()
    raise
  trainer.training_tasks = harness_tasks  # Resolved above.
  if on_open is not None:
    on_open()
  if distributed.is_primary():
    record.update(trainer)  # record.json: this phase, what it runs on, its data files.
    write_config(workdir, config)  # config.yaml: `train --config` runs this phase again.
  init_s = time.perf_counter() - started

  first_step = None  # The wait for the first step: its trace, compile and run.

  def report_startup():
    first_step.close()
    if verbose:
      from tqdm import tqdm  # Above the bar, not on its line.

      tqdm.write(compile_times.startup_line(import_s, init_s, time.perf_counter() - started),
                 file=sys.stdout)

  try:
    print(trainer.describe(), flush=True)
    print(determinism.describe(config.train.deterministic, jax.default_backend()), flush=True)
    if trainer.attention_choice is not None:
      log.info("%s", trainer.attention_choice.report())
      choice = trainer.attention_choice
      print(f"attention: {choice.name} ({choice.source})", flush=True)
    _print_lines(trainer.task.kernel_report())
    if trainer.converted:
      print(trainer.converted, flush=True)
    if trainer.step >= config.train.steps:
      print(f"resumed from step {trainer.step}; already trained to step {config.train.steps}: "
            "nothing to do", flush=True)
      result = {**_final_metrics(workdir), "step": trainer.step, "stopped_by": None}
      if trainer.missing_artefacts():  # Killed after the last save, before the artefacts.
        _print_lines(trainer.finish())
    elif stop_after is not None and trainer.step >= stop_after:
      print(f"resumed from step {trainer.step}; already at stop_after={stop_after}: nothing "
            "to do", flush=True)
      return {**_final_metrics(workdir), "step": trainer.step,
              "stopped_by": f"stop_after={stop_after}"}
    else:
      if trainer.transforms.evaluates_before_training:
        trainer.evaluate_before_training()
      print("compiling the train step ...", flush=True)
      first_step = progress.Wait("compiling the train step", said=True)
      result = trainer.fit(stop_after=stop_after, on_first_step=report_startup)
      if result["stopped_by"]:
        planned = result["stopped_by"] == f"stop_after={stop_after}"  # The caller goes on.
        print(f"stopped at step {result['step']} ({result['stopped_by']}); checkpoint saved."
              + ("" if planned else " Run the same command again to resume."), flush=True)
        return result
      _print_lines(trainer.finish())
  finally:
    if first_step is not None:
      first_step.close()  # Again does nothing.
    compile_times.stop()
    trainer.close()
  _print_done(result, workdir, trainer.task.headline(result))
  if trainer.transforms.evaluates_before_training:
    _print_lines(eval_change(workdir, config.optim.learning_rate))
  return result


def _print_lines(lines: list[str]) -> None:
  for line in lines:
    print(line, flush=True)


def _print_done(result: dict[str, Any], workdir: pathlib.Path,
                headline: dict[str, float]) -> None:
  """The run's last lines: its step, loss, the objective's `headline` metrics (a reward, a
  preference accuracy), held-out metrics, and where its files are."""
  shown = {k: v for k, v in result.items() if k.startswith("loss")}
  shown.update({**headline, **{k: v for k, v in result.items() if k.startswith("eval_")}})
  print(f"done: step {result.get('step')}, {format_metrics(shown)}", flush=True)
  print(f"metrics {workdir / METRICS_FILE}, plot {workdir / PLOT_FILE}, "
        f"checkpoints {workdir / CHECKPOINT_DIR}", flush=True)


def _final_metrics(workdir: pathlib.Path) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for line in read_metrics(workdir):
    out.update({k: v for k, v in line.items() if k != "split"})
  return out
