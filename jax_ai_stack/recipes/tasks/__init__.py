"""One Task per model family; `for_config` picks the one a recipe config names.

`FAMILIES` is the registry (`families`): the recipe config's `model` field
accepts the `model_config` of each family listed there (tagged by its `kind`).
To add a family, write its Task module and list it there; add a preset to use
it. The Task classes load on first use: the config needs only the registry.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> type(for_config(config.load("lm-tiny"))).__name__
  'LanguageModel'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jax_ai_stack.lazy import lazy_attributes
from jax_ai_stack.recipes.tasks.families import FAMILIES, Family, family

if TYPE_CHECKING:
  from jax_ai_stack.recipes.tasks.base import Task

_SUBMODULES = ("base", "choice", "classification", "custom", "families", "grpo", "lm",
               "objectives")
_EXPORTS = {
    "Batch": "base",
    "LossFn": "base",
    "QuantLayers": "base",
    "Task": "base",
    "resolve": "choice",
    "CustomTask": "custom",
    "ImageClassification": "classification",
    "classification_loss": "objectives",
    "LanguageModel": "lm",
    "lm_loss": "objectives",
}


def for_config(config: Any) -> Task:
  """The Task for a recipe config (chosen by the type of `config.model`; a model of
  one's own by its `model.task` import path)."""
  return family(config.model).task_class().for_config(config)


def example_inputs(model_config: Any, method: str = "__call__") -> tuple:
  """Zeros of the shapes one call of the model's `method` takes (`Task.example_inputs`)."""
  return family(model_config).task_class().example_inputs(model_config, method)


__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)


__all__ = [
    "FAMILIES", "Batch", "CustomTask", "Family", "ImageClassification", "LanguageModel", "LossFn",
    "QuantLayers", "Task",
    "classification_loss", "example_inputs", "family", "for_config", "lm_loss", "resolve",
]
