"""A run's workdir: its layout, its checks, and what its newest checkpoint says.

`build_run` opens a workdir in three moves that need no model: check (and, to
train, create) the directory; read the newest checkpoint's metadata; resume the
run's phases from it (`phases`). `train`, `quantize`, `lora merge` and
`import-hf` use the same checks and file names.

Example:
  >>> import pathlib
  >>> prepare_workdir(pathlib.Path("no-run-here"), read_only=True)
  Traceback (most recent call last):
  ...
  jax_ai_stack.errors.WorkdirError: no checkpoints in no-run-here: train there first
"""

from __future__ import annotations

import os
import pathlib

from jax_ai_stack.atomic import write_atomically
from jax_ai_stack.errors import CheckpointMismatchError, ConfigError, WorkdirError
from jax_ai_stack.recipes import checkpoint, configlib, phases
from jax_ai_stack.recipes.config import RecipeConfig, from_json

CHECKPOINT_DIR = "checkpoints"
"""The workdir's subdirectory of Orbax steps."""
CONFIG_FILE = "config.yaml"
"""The workdir's resolved config: `train --config W/config.yaml` runs it again."""


def default_workdir(config: RecipeConfig, workdir: str | pathlib.Path | None) -> pathlib.Path:
  """`workdir`, or runs/<recipe name> when it is None."""
  return pathlib.Path(workdir or pathlib.Path("runs") / config.name)


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


def write_config(workdir: pathlib.Path, config: RecipeConfig) -> None:
  """The resolved `config` as `workdir`/config.yaml (whole, so no preset is merged under it)."""
  write_atomically(pathlib.Path(workdir) / CONFIG_FILE,
                   "preset: none\n" + configlib.to_yaml(config))


_SHAPE_SECTIONS = ("model", "finetune", "quant")
"""The config sections that decide the checkpoint's arrays and their shapes."""


def name_changed_fields(error: CheckpointMismatchError, metadata: dict,
                         config: RecipeConfig) -> CheckpointMismatchError:
  """`error` with the config fields that differ from the checkpoint's named first.

  The saved config is validated again (`from_json`), so a field newer than the
  checkpoint compares at the value the checkpoint was written with.
  """
  try:
    saved = configlib.to_dict(from_json(metadata["config"]))
  except (KeyError, ConfigError):
    return error
  current = configlib.to_dict(config)
  changes = [f"{field}: {a!r} in the checkpoint, {b!r} now"
             for section in _SHAPE_SECTIONS
             for field, a, b in phases.changes(saved.get(section, {}),
                                               current.get(section, {}), f"{section}.")]
  if not changes:
    return error
  detail = str(error)
  return CheckpointMismatchError(f"config fields differ from the checkpoint's: "
                                 f"{'; '.join(changes)}. {detail[:1].upper()}{detail[1:]}")


def newest_metadata(workdir: pathlib.Path, capture_stderr: bool) -> dict | None:
  """The newest readable checkpoint's metadata; None when there is none (a fresh run), or
  when no step's metadata reads (the restore then says so, naming each)."""
  if not (workdir / CHECKPOINT_DIR).is_dir():
    return None
  manager = checkpoint.build_manager(workdir / CHECKPOINT_DIR, checkpoint.CheckpointConfig(),
                                     read_only=True)
  try:
    if manager.latest_step() is None:
      return None
    return checkpoint.read_metadata(manager, capture_stderr=capture_stderr)
  except WorkdirError:
    return None
  finally:
    manager.close()


def resume_phases(config: RecipeConfig, metadata: dict | None,
                   workdir: pathlib.Path) -> tuple[RecipeConfig, phases.Resumed]:
  """The config to run and the run's phases (`phases`): a fresh run's first, or a
  resumed run's (its newest `metadata`), with a new one when the config changed what a
  phase may change.

  Raises ConfigError (nothing read or written beyond the checkpoint's metadata)
  when it changed what a resumed run keeps.
  """
  given = configlib.to_dict(config)
  if metadata is None:
    return config, phases.resume({"step": 0}, given, workdir)
  resumed = phases.resume(metadata, given, workdir)
  if resumed.config != given:  # Mixture stages composed across phases.
    config = configlib.from_dict(RecipeConfig, resumed.config,
                                 source=f"{workdir}'s phases and this config")
  return config, resumed
