"""A model of your own (`kind: custom`): the config that names its Task, readable without jax.

Example:
  >>> config = CustomModelConfig(task="my_models:make_task", settings={"width": 64})
  >>> config.kind, config.settings["width"]
  ('custom', 64)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jax_ai_stack.recipes.configlib import config_dataclass


@config_dataclass
class CustomModelConfig:
  """A model of your own (`kind: custom`): what builds its Task, and its settings.

  Saved with each checkpoint like any model config, so the run's config says
  what trained it. `task` lets the commands (`eval`, `--dry-run`, a resume)
  rebuild the Task by import; without it, pass `task=` in Python.
  """

  kind: Literal["custom"] = "custom"
  """Model family; tells model configs apart in a recipe."""
  task: str | None = None
  """"module:name" of a function (or Task subclass) that takes the recipe config and
  returns the run's Task, importable from the current directory or PYTHONPATH;
  None: the Task is passed in Python (`Trainer.open(config, workdir, task=...)`)."""
  settings: dict[str, Any] = dataclasses.field(default_factory=dict)
  """Your model's own settings (any YAML mapping; `model.settings.width=64`), read by
  your code as `config.model.settings["width"]` and saved with the run."""
