"""The trainer: a recipe config in, a trained, checkpointed, resumable run out.

`run(config, workdir)` opens the workdir (restoring its newest checkpoint, or
starting from the seed), then runs one jitted step per batch, evaluates every
`train.eval_every` steps, and logs each step to `metrics.jsonl` and
TensorBoard. It saves through Orbax every `checkpoint.save_every` steps, at the
end, and when SIGTERM or SIGINT arrives (the step in flight finishes first).
At the end it writes `loss.png` and the Task's artefacts (a text sample for
language models).

What differs between model families is the `Task` (`recipes.tasks`); the
`Trainer` here has no branch on the model kind. `Trainer.open` is the one way
into a workdir: `run` trains through it, and `eval`/`generate` open a finished
run read-only through it (no train data, the run's own attention plan).

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

import contextlib
import dataclasses
import logging
import math
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import jax
from flax import nnx

from jax_ai_stack import determinism, kernels
from jax_ai_stack.absl_flags import ensure_absl_flags_parsed
from jax_ai_stack.errors import ConfigError, DataError, WorkdirError
from jax_ai_stack.recipes import (checkpoint, compile_cache, configlib, distributed, optim,
                                  sharding, step, tasks)
from jax_ai_stack.recipes.config import RecipeConfig, from_json
from jax_ai_stack.recipes.finetune import lora, quant
from jax_ai_stack.recipes.metrics import METRICS_FILE, PLOT_FILE, MetricsLog, plot, read_metrics

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
__all__ = [
    "CHECKPOINT_DIR", "METRICS_FILE", "PLOT_FILE", "Trainer", "TrainingError",
    "WorkdirError", "read_metrics", "run",
]


class TrainingError(RuntimeError):
  """Training cannot go on (a NaN loss, say); the last good checkpoint stays."""


def prepare_workdir(workdir: pathlib.Path, *, read_only: bool) -> None:
  """Checks (and for training creates) the workdir; WorkdirError says what is wrong."""
  if workdir.exists() and not workdir.is_dir():
    raise WorkdirError(f"workdir {workdir} is a file, not a directory")
  if read_only:
    if not (workdir / CHECKPOINT_DIR).is_dir():
      raise WorkdirError(f"no checkpoints in {workdir}: train there first")
    return
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe = workdir / f".write-test-{os.getpid()}"  # Other hosts may probe it too.
    probe.write_text("ok")
    probe.unlink()
  except OSError as e:
    raise WorkdirError(f"workdir {workdir} is not writable: {e.strerror or e}") from None


def resolve_attention(task: tasks.Task, workdir: pathlib.Path, *, autotune: bool,
                      saved: dict | None) -> tuple[kernels.AttentionPlan | None, kernels.Choice | None]:
  """The run's attention plan, resolved once, and the kernel its train step runs.

  Precedence: the config's implementation, then `JAX_AI_STACK_ATTENTION`, then
  the workdir's autotune file (tuned first if `autotune` and missing), then
  the backend's preference. The training request is pinned to its choice, so
  the model runs exactly the kernel logged and saved in the checkpoint.
  `saved` (a checkpoint's `attention` metadata) reuses that run's plan as is.
  """
  request = task.attention_request()
  if request is None:
    return None, None
  if saved and "plan" in saved:
    plan = kernels.AttentionPlan.from_dict(saved["plan"])
    return plan, plan.select(request)
  path = workdir / kernels.AUTOTUNE_FILENAME
  if autotune and not path.exists():
    kernels.autotune([request], path)
  plan = kernels.resolve_plan(task.attention_implementation(), origin="model.attention_impl",
                              environ=os.environ,
                              autotune_file=path if path.exists() else None)
  choice = plan.select(request)
  return plan.pin(choice), choice


def keep_trained_kernel(task: tasks.Task, manager, plan: kernels.AttentionPlan | None,
                        choice: kernels.Choice | None):
  """A resumed run keeps the kernel its checkpoint was trained with, unless asked otherwise.

  `auto` may prefer another kernel after an upgrade of this package; resuming
  on it would make the run differ from one that never stopped. An explicit
  choice (`model.attention_impl`, `JAX_AI_STACK_ATTENTION`, an autotune file)
  still wins, with the warning that the resume is not bitwise.
  """
  if choice is None or plan.source != kernels.AUTO_SOURCE:
    return plan, choice
  try:
    saved = checkpoint.read_metadata(manager).get("attention") or {}
  except WorkdirError:  # No step's metadata reads: the restore says so, naming each.
    return plan, choice
  if "plan" not in saved or saved.get("implementation") in (None, choice.name):
    return plan, choice
  try:
    trained = kernels.AttentionPlan.from_dict(saved["plan"])
    trained_choice = trained.select(task.attention_request())
  except (ValueError, kernels.NoImplementationError):  # Trained on another backend, say.
    return plan, choice
  log.info("attention: keeping %s, the kernel this run was trained with (auto now prefers %s; "
           "set model.attention_impl to change it)", trained_choice.name, choice.name)
  return trained, trained_choice


_NOT_NUMERICS = (("train", "progress"), ("train", "compile_cache"), ("train", "log_every"))
"""Config fields a resume may change without changing a single bit of the run."""


def _warn_changes(metadata: dict, config: dict, choice: kernels.Choice | None) -> None:
  """Warns about what differs from the checkpoint's run (config, attention kernel).

  A new `mesh` is no warning: the checkpoint is restored onto it bitwise
  (Orbax reshards), so only where the arrays live changed; the steps after it
  sum in another order, as on any other mesh. It is logged at info level.
  """
  saved_config = dict(metadata.get("config", {}))
  for section, field in _NOT_NUMERICS:  # Settings that change no bits: no warning.
    saved_config[section] = {k: v for k, v in saved_config.get(section, {}).items() if k != field}
    config = {**config, section: {k: v for k, v in config.get(section, {}).items() if k != field}}
  if "mesh" in saved_config and saved_config.pop("mesh") != config.get("mesh"):
    log.info("restored onto a new mesh (config mesh changed since the checkpoint)")
  _warn_config_changes(saved_config, {k: v for k, v in config.items() if k != "mesh"})
  saved = metadata.get("attention", {}).get("implementation")
  if choice is not None and saved and saved != choice.name:
    log.warning("attention was %s when the checkpoint was written and is %s now: the resumed "
                "run will not be bitwise identical to one that never stopped", saved, choice.name)


def _warn_config_changes(saved: dict, current: dict, prefix: str = "") -> None:
  """Says which settings differ from the checkpoint's: resuming with them breaks bit-exactness."""
  for key in sorted(saved.keys() | current.keys()):
    a, b = saved.get(key), current.get(key)
    if key not in saved:  # A setting newer than the checkpoint (e.g. a new section).
      log.info("config %s%s is not in the checkpoint (written by an older version)", prefix, key)
    elif isinstance(a, dict) and isinstance(b, dict):
      _warn_config_changes(a, b, f"{prefix}{key}.")
    elif a != b:
      log.warning("config %s%s changed since the checkpoint: %r -> %r", prefix, key, a, b)


class _StopSignal:
  """Records SIGTERM/SIGINT so the loop can finish its step, save and stop.

  With several processes (`shared=True`) one process must not stop alone: the
  others would wait for it in the next collective (or the save) forever. So
  SIGTERM is left to JAX's preemption notifier (which `jax.distributed`
  installs), and a SIGINT is passed on to it as a SIGTERM to this process:
  Orbax's `reached_preemption` then makes every process stop and save at the
  same step, the one that got the signal reporting it by name.
  """

  def __init__(self, *, shared: bool = False):
    self.received: str | None = None
    self._shared = shared
    self._signals = (signal.SIGINT,) if shared else (signal.SIGTERM, signal.SIGINT)
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in self._signals:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name
    if self._shared:
      os.kill(os.getpid(), signal.SIGTERM)  # To the preemption notifier: every process stops.

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


@dataclasses.dataclass
class Trainer:
  """A run opened in a workdir: its Task, model, steps, state and checkpoints."""

  config: RecipeConfig
  task: tasks.Task
  workdir: pathlib.Path
  manager: checkpoint.Manager
  model: nnx.Module
  optimizer: nnx.Optimizer
  train_step: Callable[[nnx.State, tasks.Batch], tuple[nnx.State, dict]]
  eval_step: Callable[[nnx.State, tasks.Batch], dict]
  state: nnx.State
  step: int
  attention: kernels.AttentionPlan | None
  attention_choice: kernels.Choice | None
  placement: sharding.Placement
  """The mesh and the rules that lay out the state and each batch."""
  train_batches: Iterator[tasks.Batch] | None
  """The train iterator (Grain's, checkpointed with the state); None when read-only."""
  validation: grain.IterDataset | None
  """None when evaluation is off (`train.eval_every=0`) and for generation."""
  finetune: lora.Finetune | None = None
  """A run from a trained base (`finetune`): what trains, what is saved, the base's pointer."""
  converted: str | None = None
  """What the restore converted (a step of the other `model.scan_layers` layout), else None."""

  @classmethod
  def open(cls, config: RecipeConfig, workdir: str | pathlib.Path, *,
           task: tasks.Task | None = None, resume: str = "auto",
           initial_params: Callable[[nnx.State], nnx.State] | None = None) -> Trainer:
    """Opens `workdir` to train `config`, restoring its newest checkpoint if any.

    Args:
      config: the recipe (any config with `train`, `optim`, `checkpoint`
        sections that `task` understands).
      workdir: created if missing; must be writable.
      task: the model family; default `tasks.for_config(config)`.
      resume: "auto" continues a run; "never" refuses a workdir with checkpoints.
      initial_params: a fresh run's parameters instead of the seed's initialisation:
        called with the model's abstract parameter state (ShapeDtypeStructs with
        their shardings), returns it filled (e.g. by `models.hf.load_params`).
    """
    ensure_absl_flags_parsed()
    determinism.configure(config.train.deterministic)  # Too late on a GPU: it says so.
    workdir = pathlib.Path(workdir)
    task = task or tasks.for_config(config)
    prepare_workdir(workdir, read_only=False)
    task.check_data()  # Bad input is refused before anything in the workdir is opened.
    autotune = config.train.autotune_attention
    if autotune and jax.process_count() > 1 and not (workdir / kernels.AUTOTUNE_FILENAME).exists():
      raise ConfigError(  # Each process would time the kernels and might choose another one.
          "train.autotune_attention=true tunes in one process only: run the recipe once on one "
          f"host to write {workdir / kernels.AUTOTUNE_FILENAME}, then launch every process")
    plan, choice = resolve_attention(task, workdir, autotune=autotune, saved=None)
    train_data = task.dataset("train", config.train.seed)
    validation = None
    if config.train.eval_every:
      try:
        validation = task.dataset("validation", config.train.seed)
      except DataError as e:  # The train split loaded: the held-out one is too small.
        config = _without_evaluation(config)
        print(f"note: evaluation is off for this run (train.eval_every=0): {e}", flush=True)
    manager = checkpoint.build_manager(workdir / CHECKPOINT_DIR, config.checkpoint)
    try:
      latest = manager.latest_step()
      if latest is not None and resume == "never":
        raise WorkdirError(
            f"workdir {workdir} already has checkpoints (newest step {latest}) and resume is "
            "'never': choose another --workdir, or resume with --resume auto"
        )
      if latest is not None:
        plan, choice = keep_trained_kernel(task, manager, plan, choice)
      return cls._build(config, task, workdir, manager, plan, choice, train_data, validation,
                        restore=latest is not None, initial_params=initial_params)
    except BaseException:
      manager.close()
      raise

  @classmethod
  def open_finished(cls, workdir: str | pathlib.Path, *, validation: bool = False,
                    overrides: Sequence[str] = ()) -> Trainer:
    """A trained run, read-only, with its saved config and attention plan.

    What `eval` and `generate` use: no train data is built and nothing in the
    workdir is written, so an archived run on a read-only disk works.
    `overrides` (dotted, `data.validation_fraction=0.2`) apply over the saved config.
    """
    ensure_absl_flags_parsed()
    workdir = pathlib.Path(workdir)
    prepare_workdir(workdir, read_only=True)
    manager = checkpoint.build_manager(workdir / CHECKPOINT_DIR, checkpoint.CheckpointConfig(),
                                       read_only=True)
    try:
      if manager.latest_step() is None:
        raise WorkdirError(f"no checkpoints in {workdir / CHECKPOINT_DIR}: train there first")
      metadata = checkpoint.read_metadata(manager)
      config = from_json(metadata["config"])
      if overrides:
        config = configlib.from_dict(
            RecipeConfig, configlib.apply_overrides(configlib.to_dict(config), list(overrides)),
            source=f"{workdir}'s config + overrides {' '.join(overrides)}")
      task = tasks.for_config(config)
      plan, choice = resolve_attention(task, workdir, autotune=False,
                                       saved=metadata.get("attention"))
      data = task.dataset("validation", config.train.seed) if validation else None
      return cls._build(config, task, workdir, manager, plan, choice, None, data, restore=True)
    except BaseException:
      manager.close()
      raise

  @classmethod
  def _build(cls, config, task, workdir, manager, plan, choice, train_data, validation, *,
             restore: bool, initial_params=None) -> Trainer:
    """Model, optimizer and steps, restored into (no initialisation) or initialised.

    Either way the state is created already laid out on the run's mesh (never
    a full copy on one device first). `train_data` None: read-only (no data
    position to restore, nothing to train).
    """

    finetune = lora.Finetune.of(config)

    def create(params=None):
      model = task.build_model(config.train.seed, plan, placement.layout())
      if params is not None:  # Given parameters: the initialisers become dead code.
        nnx.update(model, params)
      model = quant.qat(model, config)  # Fake quantization (quant.qat); else unchanged.
      model = finetune.apply(model)  # LoRA adapters (finetune.lora); else unchanged.
      return model, optim.build_optimizer(config.optim, model, train_steps=config.train.steps,
                                          wrt=finetune.wrt)

    placement = sharding.Placement.build(config.mesh, task.batch_axes())
    model, optimizer = nnx.eval_shape(create)  # Shapes only: nothing allocated yet.
    state_sharding = placement.state_shardings(nnx.state((model, optimizer)))
    train_step, eval_step, abstract = step.make_steps(model, optimizer, task.loss,
                                                      state_sharding=state_sharding)
    train_batches = iter(train_data) if train_data is not None else None
    restored = None
    if restore:  # Into shapes only: no initialisation when a checkpoint exists.
      abstract = jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sharding)
      restored = checkpoint.restore(manager, finetune.saved(abstract), train_batches)
      if restored is None and train_data is None:
        raise WorkdirError(f"no readable checkpoint in {manager.directory}")
    if restored is None:  # A fresh run (restore raises when steps exist and none reads).
      train_batches = iter(train_data)
      # One compiled program that writes each array straight to its devices
      # (eagerly, each initialiser would also compile on its own).
      if initial_params is None:
        state = jax.jit(lambda: finetune.saved(nnx.state(create())),  # No frozen base init.
                        out_shardings=finetune.saved(state_sharding))()
      else:  # Placed by `initial_params`, then donated: one copy on the devices.
        bare = nnx.state(nnx.eval_shape(  # The Task's model, before QAT or adapters.
            lambda: task.build_model(config.train.seed, plan, placement.layout())))
        params = initial_params(jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            bare, placement.state_shardings(bare)))
        state = jax.jit(lambda p: finetune.saved(nnx.state(create(p))),
                        out_shardings=finetune.saved(state_sharding), donate_argnums=0)(params)
      start = 0
    else:
      state = jax.device_put(restored.state, finetune.saved(state_sharding))
      start = restored.step
      if start:  # Step 0 (import-hf's) has trained under no config: nothing to keep bitwise.
        _warn_changes(restored.metadata, configlib.to_dict(config), choice)
    state = finetune.with_base(state, abstract, state_sharding,
                               restored.metadata if restored else None, model=model)
    step.merge(model, optimizer, state)  # The abstract objects now hold the arrays.
    return cls(config, task, workdir, manager, model, optimizer, train_step, eval_step,
               state, start, plan, choice, placement, train_batches, validation, finetune,
               restored.converted if restored else None)

  # ---- the pieces of the loop ------------------------------------------------

  def run_step(self) -> dict[str, jax.Array]:
    """One optimizer step on the next batch; its metrics stay on the devices.

    Nothing waits for the step: JAX dispatches it and returns, so the caller
    places the next batch on the devices while this one runs. `fetch` brings
    the metrics of several steps back at once.
    """
    batch = self.placement.batch(next(self.train_batches))
    self.state, device_metrics = self.train_step(self.state, batch)
    self.step += 1
    return device_metrics

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
      records.append((number, {**metrics, "step_time": step_time,
                               "throughput": self.task.items_per_step / max(step_time, 1e-9)}))
    return records

  def evaluate(self) -> dict[str, float]:
    """Mean metrics over the first `train.eval_batches` validation batches."""
    if self.validation is None:
      raise ConfigError("evaluation is off (train.eval_every=0): no validation split was built")
    totals: dict[str, float] = {}
    batches = 0
    iterator = iter(self.validation)
    try:
      for batch in iterator:
        if batches == self.config.train.eval_batches:
          break
        metrics = self.eval_step(self.state, self.placement.batch(batch))
        for k, v in step.host_metrics(metrics).items():
          totals[k] = totals.get(k, 0.0) + v
        batches += 1
    finally:
      if hasattr(iterator, "close"):
        iterator.close()  # Stops its prefetch thread now, not at garbage collection.
    if batches == 0:
      raise ConfigError(
          "the validation split has no full batch: lower data.batch_size, raise "
          "data.validation_fraction, or turn evaluation off with train.eval_every=0"
      )
    return self.task.evaluation({f"eval_{k}": v / batches for k, v in totals.items() if k != "tokens"})

  def eval_due(self) -> bool:
    every = self.config.train.eval_every
    return bool(every) and (self.step % every == 0 or self.step == self.config.train.steps)

  def save(self, *, force: bool) -> bool:
    """Saves state, data position and metadata as one step (see `checkpoint.save`).

    Inside `fit` the write goes on in the background; called alone, it returns
    when the step is on disk.
    """
    # Orbax copies the arrays to host memory before save() returns, so the next
    # step may donate (reuse) their buffers; the resume tests check the bits.
    metadata = {"step": self.step, "config": configlib.to_dict(self.config)}
    if self.attention_choice is not None:
      metadata["attention"] = {**self.attention_choice.to_dict(), "plan": self.attention.to_dict()}
    if self.finetune is not None and self.finetune.metadata():
      metadata["finetune"] = self.finetune.metadata()  # The base, which LoRA checkpoints lack.
    saved = self.finetune.saved(self.state) if self.finetune is not None else self.state
    return checkpoint.save(self.manager, self.step, saved, self.train_batches, metadata,
                           force=force)

  def preempted(self) -> bool:
    """Whether every host agreed to stop at this step (Orbax; multi-host only)."""
    return jax.process_count() > 1 and self.manager.reached_preemption(self.step)

  def _stop_reason(self, stop: _StopSignal) -> str | None:
    """The signal that stops the run now, "preemption" for another process's, or None."""
    if jax.process_count() == 1:
      return stop.received
    return (stop.received or "preemption") if self.preempted() else None

  def fit(self, *, stop_after: int | None = None,
          on_first_step: Callable[[], None] | None = None) -> dict[str, Any]:
    """Trains from `self.step` to `train.steps`; returns the last metrics.

    `stop_after` stops (and saves) after that step as a preemption would.
    `on_first_step` is called once the first step (and its compile) is done.
    """
    total = self.config.train.steps
    primary = distributed.is_primary()
    metrics_log = MetricsLog(self.workdir, self.step, enabled=primary)
    schedule = jax.jit(optim.build_schedule(
        self.config.optim, optim.optimizer_updates(self.config.optim, total)))
    progress = _progress_bar(self.config, self.step)
    stopped_by = None
    last: dict[str, float] = {}
    pending: list[tuple[int, dict]] = []  # Steps dispatched, metrics not yet fetched.
    try:
      # Saves in the background; leaving the block waits until they are on disk.
      with (_StopSignal(shared=jax.process_count() > 1) as stop, self._kernel_configs(),
            self.manager.async_saves()):
        since = time.perf_counter()
        while self.step < total:
          pending.append((self.step + 1, self.run_step()))
          reached = stop_after is not None and self.step >= stop_after
          stopping = self._stop_reason(stop) or (f"stop_after={stop_after}" if reached else None)
          saving = bool(stopping) or self.step == total or self.manager.should_save(self.step)
          evaluating = self.eval_due()
          if (saving or evaluating or on_first_step is not None
              or self.step % self.config.train.log_every == 0):
            for number, metrics in self.fetch(pending, since):
              updates = (number - 1) // self.config.optim.accumulate_steps
              last = {**metrics, "lr": float(schedule(updates))}
              metrics_log.write(number, "train", last)
            if progress is not None:
              progress.update(len(pending))
              progress.set_postfix_str(f"loss {last['loss']:.3f}  "
                                       f"{last['throughput']:,.0f} {self.task.throughput_unit}/s")
            pending = []
            since = time.perf_counter()
            if on_first_step is not None:
              on_first_step()
              on_first_step = None
          if evaluating:
            eval_metrics = self.evaluate()
            metrics_log.write(self.step, "eval", eval_metrics)
            last.update(eval_metrics)
            _print(progress, f"step {self.step}: " + _format(eval_metrics))
          if self.save(force=bool(stopping) or self.step == total):
            metrics_log.flush()
          if stopping:
            stopped_by = stopping
            break
          if saving or evaluating:
            since = time.perf_counter()  # Step times leave out evaluations and saves.
    finally:
      if progress is not None:
        progress.close()
      metrics_log.close()
    step.merge(self.model, self.optimizer, self.state)
    return {"step": self.step, "stopped_by": stopped_by, **last}

  def finish(self) -> list[str]:
    """The end-of-run artefacts (loss plot, the Task's); lines to print.

    Every process runs the Task's computations (a sample needs all of a
    sharded model); only the first writes files.
    """
    primary = distributed.is_primary()
    if primary:
      plot(self.workdir)
    with self._kernel_configs():
      return self.task.finish(self.inference_model(), self.workdir if primary else None)

  def missing_artefacts(self) -> list[str]:
    names = [PLOT_FILE, *self.task.artefacts()]
    return [name for name in names if not (self.workdir / name).exists()]

  def generate(self, prompt: str, max_new_tokens: int, temperature: float, *,
               seed: int | None = None, top_k: int | None = None,
               top_p: float | None = None) -> str:
    """`prompt` continued; `seed` None: the run's `train.seed`."""
    seed = self.config.train.seed if seed is None else seed
    with self._kernel_configs():
      return self.task.generate(self.inference_model(), prompt, max_new_tokens, temperature,
                                seed, top_k=top_k, top_p=top_p)

  def inference_model(self) -> nnx.Module:
    """The model that decodes: a LoRA run's base and adapters merged (Qwix adds
    the adapters only inside `__call__`, not in `decode`)."""
    if self.finetune is None or self.finetune.lora is None:
      return self.model
    return lora.merged_model(self.model, lambda: self.task.build_model(
        self.config.train.seed, self.attention, self.placement.layout()), self.finetune.scale)

  def close(self) -> None:
    self.manager.close()

  def _kernel_configs(self):
    """tokamax's tuned kernel configs (from an autotune file) while steps trace."""
    return self.attention.kernel_configs() if self.attention else contextlib.nullcontext()

  def describe(self) -> str:
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(self.model, nnx.Param)))
    if self.finetune is not None and self.finetune.lora is not None:
      trained = sum(x.size for x in jax.tree.leaves(nnx.state(self.model, nnx.LoRAParam)))
      n_params = f"{n_params:,} parameters ({trained:,} in LoRA adapters, the rest frozen)"
    else:
      n_params = f"{n_params:,} parameters"
    return (f"recipe {self.config.name}: {n_params} on {jax.default_backend()} "
            f"({jax.device_count()} device(s), {self.placement.describe()}); "
            f"workdir {self.workdir}")


def _progress_bar(config: RecipeConfig, start: int):
  """tqdm's bar on a terminal; elsewhere (CI, SLURM, a pipe) one plain line per log interval."""
  if not config.train.progress:
    return None
  if not sys.stderr.isatty():
    return LogLines(config.train.steps, start)
  from tqdm import tqdm

  return tqdm(total=config.train.steps, initial=start, desc="train", unit="step",
              file=sys.stderr, mininterval=0.5, dynamic_ncols=True)


class LogLines:
  """The progress bar's stand-in where stderr is no terminal: a bar redrawn there is
  kilobytes of carriage returns; this writes `step N/TOTAL: loss ..., ETA ...` lines."""

  def __init__(self, total: int, initial: int):
    self.n, self.total, self._initial = initial, total, initial
    self._started = time.perf_counter()

  def update(self, steps: int) -> None:
    self.n += steps

  def set_postfix_str(self, text: str) -> None:
    done, elapsed = self.n - self._initial, time.perf_counter() - self._started
    eta = elapsed / done * (self.total - self.n) if done else 0.0
    print(f"step {self.n}/{self.total}: {text}, ETA {_duration(eta)}", file=sys.stderr,
          flush=True)

  @staticmethod
  def write(text: str, file=None) -> None:
    print(text, file=file, flush=True)

  def close(self) -> None:
    pass


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(round(seconds), 60)
  return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _print(progress, text: str) -> None:
  if progress is not None:
    progress.write(text, file=sys.stdout)
  else:
    print(text, flush=True)


def _format(metrics: dict[str, float]) -> str:
  return ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())


def _without_evaluation(config):
  """`config` with `train.eval_every=0`: a run whose validation split has no full batch."""
  return dataclasses.replace(config, train=dataclasses.replace(config.train, eval_every=0))


def default_workdir(config: RecipeConfig, workdir: str | pathlib.Path | None) -> pathlib.Path:
  """`workdir`, or runs/<recipe name> when it is None."""
  return pathlib.Path(workdir or pathlib.Path("runs") / config.name)


def run(
    config: RecipeConfig,
    workdir: str | pathlib.Path | None = None,
    *,
    task: tasks.Task | None = None,
    resume: str | None = None,
    stop_after: int | None = None,
    verbose: bool = False,
    import_s: float | None = None,
    on_open: Callable[[], None] | None = None,
) -> dict[str, Any]:
  """Trains `config` in `workdir` (default runs/<name>); returns the final metrics.

  A finished run (rerun) does nothing but make sure its artefacts exist.
  `stop_after` stops (and saves) after that step as a preemption would; the
  next call resumes from there. The result's `stopped_by` names what stopped
  the run early ("SIGTERM", "SIGINT", "stop_after=N", "preemption") or is None.
  `verbose` prints one start-up line after the first step: `import_s` (the
  caller's import of the libraries), init, trace and compile seconds, cache hits.
  `on_open` is called once the workdir is open (bad input refused, checkpoint read).
  """
  workdir = default_workdir(config, workdir)
  print(f"recipe {config.name}: preparing data and model in {workdir} ...", flush=True)
  started = time.perf_counter()
  compile_times = compile_cache.CompileTimes().start()
  try:
    trainer = Trainer.open(config, workdir, task=task, resume=resume or config.train.resume)
  except BaseException:
    compile_times.stop()
    raise
  if on_open is not None:
    on_open()
  init_s = time.perf_counter() - started

  def report_startup():
    compile_times.stop()
    if verbose:
      from tqdm import tqdm  # Above the bar, not on its line.

      tqdm.write(_startup_line(compile_times, import_s, init_s, time.perf_counter() - started),
                 file=sys.stdout)

  try:
    print(trainer.describe(), flush=True)
    print(determinism.describe(config.train.deterministic, jax.default_backend()), flush=True)
    if trainer.attention_choice is not None:
      log.info("%s", trainer.attention_choice.report())
      choice = trainer.attention_choice
      print(f"attention: {choice.name} ({choice.source})", flush=True)
    if trainer.step:
      print(f"resumed from step {trainer.step}", flush=True)
    if trainer.converted:
      print(trainer.converted, flush=True)
    if trainer.step >= config.train.steps:
      print(f"already trained to step {config.train.steps}: nothing to do", flush=True)
      result = {**_final_metrics(workdir), "step": trainer.step, "stopped_by": None}
      if trainer.missing_artefacts():  # Killed after the last save, before the artefacts.
        _print_lines(trainer.finish())
    else:
      lora.eval_before(trainer)  # A fine-tuning run: the base's held-out loss, as step 0.
      print("compiling the train step ...", flush=True)
      result = trainer.fit(stop_after=stop_after, on_first_step=report_startup)
      if result["stopped_by"]:
        print(f"stopped at step {result['step']} ({result['stopped_by']}); checkpoint saved. "
              "Run the same command again to resume.", flush=True)
        return result
      _print_lines(trainer.finish())
  finally:
    compile_times.stop()
    trainer.close()
  _print_done(result, workdir)
  change = lora.eval_change(workdir) if trainer.finetune and trainer.finetune.config.active else None
  if change:
    print(change, flush=True)
  return result


def _startup_line(times: compile_cache.CompileTimes, import_s: float | None, init_s: float,
                  first_step_s: float) -> str:
  """Where the wait for the first step went: import, init, trace, compile, cache hits."""
  imported = f"import {import_s:.1f} s, " if import_s is not None else ""
  cache = compile_cache.active_dir()
  hits = f"{times.cache_hits} loaded from the cache {cache}" if cache else "no persistent cache"
  return (f"start-up: {imported}init {init_s:.1f} s (data, model, checkpoint), "
          f"first step after {first_step_s:.1f} s; of which trace {times.trace_s:.1f} s, "
          f"compile {times.compile_s:.1f} s ({times.compiles} programs, {hits})")


def _print_lines(lines: list[str]) -> None:
  for line in lines:
    print(line, flush=True)


def _print_done(result: dict[str, Any], workdir: pathlib.Path) -> None:
  shown = {k: v for k, v in result.items() if k.startswith(("loss", "eval_"))}
  print(f"done: step {result.get('step')}, {_format(shown)}", flush=True)
  print(f"metrics {workdir / METRICS_FILE}, plot {workdir / PLOT_FILE}, "
        f"checkpoints {workdir / CHECKPOINT_DIR}", flush=True)


def _final_metrics(workdir: pathlib.Path) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for record in read_metrics(workdir):
    out.update({k: v for k, v in record.items() if k != "split"})
  return out
