"""Opening a workdir, to train or to read: what it settles before the model exists.

`build_run`'s first half. To train: the workdir checked (and created), the
newest checkpoint's phases resumed, the Task's data built and checked, the
attention plan chosen (the checkpoint's kernel on a resume), the checkpoint
manager opened. To read: the saved config (with overrides) and attention plan,
no train data, nothing written. Either way an `Opened`, from which `run`
assembles the model, optimizer and state.

Example:
  >>> import pathlib
  >>> open_finished(pathlib.Path("no-run-here"), environ={}, overrides=(), task=None,
  ...               validation=False, capture_stderr=False)
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.WorkdirError: no checkpoints in no-run-here: train there first
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Union

import grain
import jax

from jax_ai_stack import determinism, kernels, logs
from jax_ai_stack.errors import ConfigError, DataError, UserError, WorkdirError
from jax_ai_stack.recipes import checkpoint, configlib, phases, preflight, sharding, tasks
from jax_ai_stack.recipes import workdir as workdir_lib
from jax_ai_stack.recipes.config import RecipeConfig, from_json

TaskArg = Union[tasks.Task, Callable[[RecipeConfig], tasks.Task], None]
"""A run's Task: given, built from the config by a function, or None (the config's)."""


@dataclasses.dataclass(frozen=True)
class Opened:
  """What opening a workdir settled, before the model and state exist."""

  config: RecipeConfig
  task: tasks.Task
  workdir: pathlib.Path
  manager: checkpoint.Manager
  plan: kernels.AttentionPlan | None
  choice: kernels.Choice | None
  placement: sharding.Placement
  train_data: grain.IterDataset | None
  """None: read-only (no data position to restore, nothing to train)."""
  validation: grain.IterDataset | None
  restore: bool
  """Whether the manager has a step to restore."""
  capture_stderr: bool
  """`build_run`'s: how the checkpoint is read."""
  resumed: phases.Resumed | None = None
  """The run's phases (train); None: read-only, the saved ones."""


def open_to_train(config: RecipeConfig, workdir: pathlib.Path, *, environ: Mapping[str, str],
                   resume: str, task: TaskArg, validation: bool | None,
                   capture_stderr: bool) -> Opened:
  """Checks, data, attention plan and checkpoint manager of a run to train."""
  determinism.configure(config.train.deterministic)  # Too late on a GPU: it says so.
  preflight.check_references(config)  # The Python it names imports: before the workdir.
  created = not workdir.exists()
  workdir_lib.prepare_workdir(workdir, read_only=False)
  try:
    metadata = workdir_lib.newest_metadata(workdir, capture_stderr) if resume != "never" else None
    config, resumed = workdir_lib.resume_phases(config, metadata, workdir)
    task = tasks.resolve(task, config)
    if getattr(config.train, "eval_tasks", ()) and not hasattr(task, "tokenizer"):
      raise ConfigError(f"train.eval_tasks: {type(task).__name__} has no language model to "
                        "run lm-evaluation-harness tasks on")
    opened = _open_data_and_manager(config, workdir, task, environ=environ, resume=resume,
                                    validation=validation, capture_stderr=capture_stderr,
                                    saved_attention=(metadata or {}).get("attention"))
    return dataclasses.replace(opened, resumed=resumed)
  except UserError:
    if created and not any(workdir.iterdir()):  # Refused input leaves no empty workdir.
      workdir.rmdir()
    raise


def _open_data_and_manager(config: RecipeConfig, workdir: pathlib.Path, task: tasks.Task, *,
                           environ: Mapping[str, str], resume: str, validation: bool | None,
                           capture_stderr: bool, saved_attention: dict | None) -> Opened:
  """The data, attention plan and checkpoint manager; `saved_attention`: the newest
  checkpoint's attention metadata, whose kernel a resume keeps (None: none reads)."""
  task.check_data()  # Bad input is refused before anything in the workdir is opened.
  placement = sharding.Placement.build(config.mesh, task.batch_axes())
  placement.check_rows(_batch_rows(config))  # Each size the schedule will reach: now.
  autotune_path = workdir / kernels.AUTOTUNE_FILENAME
  if config.train.autotune_attention and not autotune_path.exists():
    if jax.process_count() > 1:
      raise ConfigError(  # Each process would time the kernels and might choose another one.
          "train.autotune_attention=true tunes in one process only: run the recipe once on one "
          f"host to write {autotune_path}, then launch every process")
    if task.attention_request() is not None:
      kernels.autotune([task.attention_request()], autotune_path)
  settings = dict(implementation=task.attention_implementation(), environ=environ,
                  autotune_file=kernels.workdir_autotune_file(workdir))
  plan, choice = kernels.plan_for_run(task.attention_request(), **settings)  # Bad names: now.
  train_data = task.dataset("train", config.train.seed)
  validation_data = None
  if config.train.eval_every if validation is None else validation:
    try:
      validation_data = task.dataset("validation", config.train.seed)
    except DataError as e:  # The train split loaded: the held-out one is too small.
      config = _without_evaluation(config)
      logs.note("no held-out evaluation in this run (train.eval_every=0): "
                + str(e).removeprefix("data: "))
  manager = checkpoint.build_manager(workdir / workdir_lib.CHECKPOINT_DIR, config.checkpoint)
  try:
    latest = manager.latest_step()
    if latest is not None and resume == "never":
      raise WorkdirError(
          f"workdir {workdir} already has checkpoints (newest step {latest}) and resume is "
          "'never': choose another --workdir, or resume with --resume auto"
      )
    if latest is not None:  # The kernel it trained with, unless one is named.
      plan, choice = kernels.plan_for_run(task.attention_request(), **settings,
                                          saved=saved_attention)
  except BaseException:
    manager.close()
    raise
  return Opened(config=config, task=task, workdir=workdir, manager=manager, plan=plan,
                 choice=choice, placement=placement, train_data=train_data,
                 validation=validation_data, restore=latest is not None,
                 capture_stderr=capture_stderr)


def _batch_rows(config: RecipeConfig) -> list[tuple[str, int]]:
  """(field, rows) of every batch a step of `config` passes through the model at once (a
  config without a `data` section: its Task's batches, checked as they come)."""
  data = getattr(config, "data", None)
  sizes = data.batch_sizes() if data is not None else []
  micro = getattr(config.train, "microbatch_size", None)
  if micro is not None and any(rows > micro for _, rows in sizes):
    sizes.append(("train.microbatch_size", micro))
  return sizes


def open_finished(workdir: pathlib.Path, *, environ: Mapping[str, str],
                   overrides: Sequence[str], task: TaskArg, validation: bool,
                   capture_stderr: bool) -> Opened:
  """A trained run, read-only, with its saved config and attention plan.

  No train data is built and nothing in the workdir is written, so an
  archived run on a read-only disk works.
  """
  workdir_lib.prepare_workdir(workdir, read_only=True)
  checkpoints = workdir / workdir_lib.CHECKPOINT_DIR
  manager = checkpoint.build_manager(checkpoints, checkpoint.CheckpointConfig(),
                                     read_only=True)
  try:
    if manager.latest_step() is None:
      raise WorkdirError(f"no checkpoints in {checkpoints}: train there first")
    metadata = checkpoint.read_metadata(manager, capture_stderr=capture_stderr)
    config = from_json(metadata["config"])
    if overrides:
      config = configlib.from_dict(
          RecipeConfig, configlib.apply_overrides(configlib.to_dict(config), list(overrides)),
          source=f"{workdir}'s config + overrides {' '.join(overrides)}")
    task = tasks.resolve(task, config)
    plan, choice = kernels.plan_for_run(
        task.attention_request(), task.attention_implementation(), environ=environ,
        autotune_file=kernels.workdir_autotune_file(workdir), saved=metadata.get("attention"),
        read_only=True)
    data = task.dataset("validation", config.train.seed) if validation else None
  except BaseException:
    manager.close()
    raise
  return Opened(config=config, task=task, workdir=workdir, manager=manager, plan=plan,
                 choice=choice, placement=sharding.Placement.build(config.mesh, task.batch_axes()),
                 train_data=None, validation=data, restore=True, capture_stderr=capture_stderr)


def _without_evaluation(config):
  """`config` with `train.eval_every=0`: a run whose validation split has no full batch."""
  return dataclasses.replace(config, train=dataclasses.replace(config.train, eval_every=0))
