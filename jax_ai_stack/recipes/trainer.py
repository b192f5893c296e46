"""The Trainer: a `Run` with the training loop (one step per batch, evaluation, saves).

`Trainer.fit` dispatches steps without waiting, fetches metrics every
`train.log_every` steps, evaluates every `train.eval_every`, saves through
Orbax every `checkpoint.save_every` steps and at the end, and stops after
saving when SIGTERM or SIGINT arrives (the step in flight finishes first).
`train.run` is the command's whole course around it (checks, start-up lines,
artefacts, summary); `Trainer.open` and `Trainer.open_finished` open a run
for notebooks.

Determinism: the parameters, optimizer state, RNG state and data position at
step k are all in checkpoint k, and every step is a pure function of them, so a
run stopped at any step and resumed ends with the same bits as one that never
stopped. Log lines past the restored step are dropped on resume, so the loss
log is the same too.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> cfg = config.load("lm-tiny", overrides=["train.steps=2", "model.num_layers=1"])
  >>> trainer = Trainer.open(cfg, "/tmp/doctest-run", resume="never")  # doctest: +SKIP
  >>> trainer.fit()["step"]  # doctest: +SKIP
  2
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jax_ai_stack.recipes import distributed, optim, phases, preflight, profile, step
from jax_ai_stack.recipes import progress as progress_lib
from jax_ai_stack.recipes.config import RecipeConfig
from jax_ai_stack.recipes.data.batch_schedule import BatchSchedule
from jax_ai_stack.recipes.metrics import PLOT_FILE, MetricsLog, format_metrics, plot
from jax_ai_stack.recipes.run import Run, TaskArg, build_run
from jax_ai_stack.recipes.stop_signal import StopSignal

__all__ = ["Trainer", "TrainingError"]


class TrainingError(RuntimeError):
  """Training cannot go on (a NaN loss, say); the last good checkpoint stays."""


class Trainer(Run):
  """A `Run` being trained: one step per batch, evaluation, saves, stop on a signal."""

  @classmethod
  def of(cls, run: Run) -> Trainer:
    """`run` (what `build_run` opened) as a Trainer."""
    return cls(**{field.name: getattr(run, field.name) for field in dataclasses.fields(Run)})

  @classmethod
  def open(cls, config: RecipeConfig, workdir: str | pathlib.Path, *,
           task: TaskArg = None, resume: str = "auto",
           initial_params: Callable[[nnx.State], nnx.State] | None = None,
           environ: Mapping[str, str] | None = None) -> Trainer:
    """`build_run(config, workdir, mode="train", ...)` as a Trainer (for notebooks).

    Args:
      config: the recipe (any config with `train`, `optim`, `checkpoint`
        sections that `task` understands).
      workdir: created if missing; must be writable.
      task: the model family: a Task, or a function (or Task subclass) called with
        `config`; default `tasks.for_config(config)`.
      resume: "auto" continues a run; "never" refuses a workdir with checkpoints.
      initial_params: a fresh run's parameters instead of the seed's initialisation
        (see `build_run`).
      environ: where `JAX_AI_STACK_ATTENTION` is read; None: the process's environment.
    """
    return cls.of(build_run(config, workdir, mode="train", task=task, resume=resume,
                            initial_params=initial_params, environ=environ))

  @classmethod
  def open_finished(cls, workdir: str | pathlib.Path, *, validation: bool = False,
                    overrides: Sequence[str] = (), task: TaskArg = None,
                    optimizer_state: bool = False) -> Trainer:
    """A trained run, read-only, with its saved config and attention plan (for notebooks).

    `build_run(None, workdir, mode="read", ...)`: no train data is built and
    nothing in the workdir is written. `overrides` (dotted,
    `data.validation_fraction=0.2`) apply over the saved config. `task`: a
    model of one's own, as a function (or Task subclass) called with the
    saved config, or a Task; default: the one the saved config names.
    `optimizer_state`: read the optimizer's state too (by default the model alone).
    """
    return cls.of(build_run(None, workdir, mode="read", validation=validation,
                            overrides=overrides, task=task, optimizer_state=optimizer_state))

  # ---- the pieces of the loop ------------------------------------------------

  def run_step(self) -> dict[str, jax.Array]:
    """One optimizer step on the next batch; its metrics stay on the devices.

    Nothing waits for the step: JAX dispatches it and returns, so the caller
    places the next batch on the devices while this one runs. `fetch` brings
    the metrics of several steps back at once.
    """
    if self.task.rollouts is None:
      batch, rollout_metrics = next(self.train_batches), {}
    else:
      batch, rollout_metrics = self._rollout_batch()
    self.state, device_metrics = self.train_step(self.state, self.placement.batch(batch))
    self.step += 1
    return {**device_metrics, **rollout_metrics}

  def _rollout_batch(self) -> tuple[dict, dict[str, float]]:
    """Reinforcement learning: the batch sampled from the policy as it is (`rl.Rollouts`)
    at a rollout boundary, with its metrics; the same rows, marked not fresh, for the
    other `rl.updates_per_rollout` steps."""
    if not self.at_rollout_boundary():
      return {**self._rollout, "fresh": np.zeros_like(self._rollout["fresh"])}, {}
    step.merge(self.model, self.optimizer, self.state)
    self._rollout, metrics = self.task.rollouts.batch(
        self.inference_model(), lambda: next(self.train_batches), self.step)
    return self._rollout, metrics

  def at_rollout_boundary(self) -> bool:
    """Whether the next step starts a rollout (always, for a run that has none): where a
    run may stop, since a rollout's batch is not saved."""
    if self.task.rollouts is None:
      return True
    return self.step % self.config.rl.updates_per_rollout == 0

  def fetch(self, pending: list[tuple[int, dict]], since: float) -> list[tuple[int, dict]]:
    """(step, metrics as floats) of the `pending` steps, fetched in one transfer.

    The wall time from `since` (`time.perf_counter()` before the first of them)
    to the end of the transfer, which waits for the last step, is shared out
    evenly as each one's `step_time`. Raises TrainingError at the first
    non-finite loss: callers fetch before every save, so no such state is ever
    saved.
    """
    fetched_metrics = jax.device_get([m for _, m in pending])
    step_time = (time.perf_counter() - since) / len(pending)
    data = getattr(self.config, "data", None)  # Items scale with a scheduled batch size.
    batches = BatchSchedule.of(data) if data is not None else None
    records = []
    for number, fetched in zip([n for n, _ in pending], fetched_metrics):
      metrics = {k: float(v) for k, v in fetched.items()}
      if not all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm")):
        raise TrainingError(
            f"step {number}: loss {metrics['loss']}, gradient norm {metrics['grad_norm']} "
            f"is not finite; training stopped. The last good checkpoint "
            f"(step {self.manager.latest_step()}) is kept in {self.manager.directory}"
        )
      metrics.pop("tokens", None)
      items = self.task.items_per_step
      if batches is not None:
        items *= batches.size(number - 1) / data.batch_size
      records.append((number, {**metrics, "step_time": step_time,
                               "throughput": items / max(step_time, 1e-9)}))
    return records

  def evaluate_before_training(self) -> None:
    """The evaluation before the first step, logged as step 0 and printed (a fine-tuning
    run's base: its later evaluations show what tuning changed on the held-out text)."""
    if self.step or self.validation is None:
      return
    metrics = {**self.evaluate(), **self.harness_metrics()}
    # -1: an attempt killed before its first checkpoint logged this evaluation too; it goes.
    log = MetricsLog(self.workdir, -1, enabled=distributed.is_primary())
    try:
      log.write(0, "eval", metrics)
    finally:
      log.close()
    print(f"before fine-tuning: {format_metrics(metrics)}", flush=True)

  @functools.cached_property
  def training_tasks(self):
    """`train.eval_tasks` resolved (`evaluation.in_training.TrainingTasks`); None without
    them. ConfigError for a bad name (`train.run` resolves them before the run opens and
    sets this; `opening` refuses them for a Task with no language model)."""
    return preflight.check(self.config, self.workdir)

  def harness_metrics(self) -> dict[str, float]:
    """`train.eval_tasks`' metrics on the model as it stands, where they are due at this
    step; {} elsewhere."""
    tasks = self.training_tasks
    if tasks is None or not tasks.due(self.step):
      return {}
    step.merge(self.model, self.optimizer, self.state)
    return tasks.measure(self)

  def eval_due(self) -> bool:
    every = self.config.train.eval_every
    return bool(every) and (self.step % every == 0 or self.step == self.config.train.steps)

  def preempted(self) -> bool:
    """Whether every host agreed to stop at this step (Orbax; multi-host only)."""
    return jax.process_count() > 1 and self.manager.reached_preemption(self.step)

  def _stop_reason(self, stop: StopSignal) -> str | None:
    """The signal that stops the run now, "preemption" for another process's, or None."""
    if jax.process_count() == 1:
      return stop.received
    return (stop.received or "preemption") if self.preempted() else None

  def fit(self, *, stop_after: int | None = None,
          on_first_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Trains from `self.step` to `train.steps`; returns the last metrics.

    Says so when it resumes a run, and leaves `loss.png` (the metrics so far)
    in the workdir when it returns. `stop_after` stops (and saves) after that
    step as a preemption would. `on_first_step` is called once the first step
    (and its compile) is done.
    """
    total = self.config.train.steps
    primary = distributed.is_primary()
    if self.step:
      print(f"resumed from step {self.step}", flush=True)
    if self.phase_changes:  # Resumed with other settings: they apply from this step on.
      print(f"phase {len(self.phases)} from step {self.step}: "
            f"{phases.describe(self.phase_changes)}", flush=True)
    metrics_log = MetricsLog(self.workdir, self.step, enabled=primary)
    schedule = jax.jit(optim.build_schedule(
        self.config.optim, optim.optimizer_updates(self.config.optim, total)))
    progress = _progress_bar(self.config, self.step)
    profiler = profile.StepProfiler(self.config.train.profile_steps, self.workdir, enabled=primary)
    stopped_by = None
    last: dict[str, float] = {}
    headline: dict[str, float] = {}  # The newest of each (a rollout's only at its first step).
    pending: list[tuple[int, dict]] = []  # Steps dispatched, metrics not yet fetched.
    try:
      # Saves in the background; leaving the block waits until they are on disk.
      with (StopSignal(shared=jax.process_count() > 1) as stop, self.kernel_configs(),
            self.manager.async_saves()):
        since = time.perf_counter()
        while self.step < total:
          with profiler.step(self.step + 1):
            pending.append((self.step + 1, self.run_step()))
          if (line := profiler.after(self.step, self.state)) is not None:
            progress_lib.say(progress, line)
          reached = stop_after is not None and self.step >= stop_after
          stopping = self._stop_reason(stop) or (f"stop_after={stop_after}" if reached else None)
          if not self.at_rollout_boundary():
            stopping = None  # Inside a rollout: its updates finish first (a signal stays).
          saving = bool(stopping) or self.step == total or self.manager.should_save(self.step)
          evaluating = self.eval_due()
          if (saving or evaluating or on_first_step is not None
              or self.step % self.config.train.log_every == 0):
            for number, metrics in self.fetch(pending, since):
              updates = (number - 1) // self.config.optim.accumulate_steps
              last = {**metrics, "lr": float(schedule(updates)), **self.task.data_metrics(number)}
              metrics_log.write(number, "train", last)
              headline.update(self.task.headline(last))
              if self.task.rollouts is not None and (
                  line := self.task.rollouts.notice(metrics)) is not None:
                progress_lib.say(progress, f"step {number}: {line}")
            if progress is not None:
              progress.update(len(pending))
              progress.set_postfix_str(progress_text(last, headline, self.task.throughput_unit))
            pending = []
            since = time.perf_counter()
            if on_first_step is not None:
              on_first_step()
              on_first_step = None
          if evaluating:
            with progress_lib.waiting(f"evaluating at step {self.step}"):  # Said if long.
              eval_metrics = {**self.evaluate(), **self.harness_metrics()}
            metrics_log.write(self.step, "eval", eval_metrics)
            last.update(eval_metrics)
            progress_lib.say(progress, f"step {self.step}: " + format_metrics(eval_metrics))
          if self.save(force=bool(stopping) or self.step == total):
            metrics_log.flush()
          if stopping:
            stopped_by = stopping
            break
          if saving or evaluating:
            since = time.perf_counter()  # Step times leave out evaluations and saves.
    finally:
      if (line := profiler.stop(self.state)) is not None:  # Stopped inside the range.
        progress_lib.say(progress, line)
      if progress is not None:
        progress.close()
      metrics_log.close()
    step.merge(self.model, self.optimizer, self.state)
    if primary:
      plot(self.workdir)
    return {"step": self.step, "stopped_by": stopped_by, **headline, **last}

  def finish(self) -> list[str]:
    """The end-of-run artefacts (loss plot, the Task's); lines to print.

    Every process runs the Task's computations (a sample needs all of a
    sharded model); only the first writes files.
    """
    primary = distributed.is_primary()
    if primary:
      plot(self.workdir)
    with self.kernel_configs():
      return self.task.finish(self.inference_model(), self.workdir if primary else None)

  def missing_artefacts(self) -> list[str]:
    names = [PLOT_FILE, *self.task.artefacts()]
    return [name for name in names if not (self.workdir / name).exists()]


def progress_text(last: dict[str, float], headline: dict[str, float], unit: str) -> str:
  """The progress bar's text: the loss, the objective's headline metrics (`Task.headline`:
  GRPO's reward and its parts, DPO's preference accuracy) and the throughput.

  Example:
    >>> progress_text({"loss": 0.0, "throughput": 1234.5}, {"reward": 0.625}, "tokens")
    'loss 0.000, reward 0.625  1,234 tokens/s'
  """
  return (f"{format_metrics({'loss': last['loss'], **headline})}  "
          f"{last['throughput']:,.0f} {unit}/s")


def _progress_bar(config: RecipeConfig, start: int):
  """The steps' bar (plain `step N/TOTAL` lines off a terminal); None: train.progress=false."""
  if not config.train.progress:
    return None
  return progress_lib.bar("train", unit="step", total=config.train.steps, initial=start)
