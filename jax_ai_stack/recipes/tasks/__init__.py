"""One Task per model family; `for_config` picks the one a recipe config names.

`FAMILIES` is the registry: the recipe config's `model` field accepts the
`model_config` of each family listed here (tagged by its `kind`). To add a
family, write its Task module and list it here; add a preset to use it.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> type(for_config(config.load("lm-tiny"))).__name__
  'LanguageModel'
"""

from __future__ import annotations

from typing import Any

from jax_ai_stack.recipes.tasks.base import Batch, LossFn, Task
from jax_ai_stack.recipes.tasks.classification import ImageClassification, classification_loss
from jax_ai_stack.recipes.tasks.lm import LanguageModel, lm_loss

FAMILIES: tuple[type[Task], ...] = (LanguageModel, ImageClassification)
"""Every model family a recipe config can name."""


def family(model_config: Any) -> type[Task]:
  """The Task class whose model config `model_config` is."""
  for task in FAMILIES:
    if isinstance(model_config, task.model_config):
      return task
  raise TypeError(f"no Task trains a {type(model_config).__name__}; known: "
                  + ", ".join(t.model_config.__name__ for t in FAMILIES))


def for_config(config: Any) -> Task:
  """The Task for a recipe config (chosen by the type of `config.model`)."""
  return family(config.model)(config)


__all__ = [
    "FAMILIES", "Batch", "ImageClassification", "LanguageModel", "LossFn", "Task",
    "classification_loss", "family", "for_config", "lm_loss",
]
