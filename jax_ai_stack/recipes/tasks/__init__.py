"""One Task per kind of model; `for_config` picks the one a recipe config names.

`REGISTRY` (`registry`): the recipe config's `model` field accepts the
`model_config` of each Task registered there (tagged by its `kind`). To add a
Task, write its module and register it there; add a preset to use it. The Task
classes load on first use: the config needs only the registry. `Family`,
`FAMILIES` and `family`, the registry's first names, still import with a
DeprecationWarning.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> type(for_config(config.load("lm-tiny"))).__name__
  'LanguageModel'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jax_ai_stack.lazy import lazy_attributes
from jax_ai_stack.recipes.tasks.registry import REGISTRY, RegisteredTask, registered

if TYPE_CHECKING:
  from jax_ai_stack.recipes.tasks.base import Task

_SUBMODULES = ("base", "choice", "classification", "custom", "distillation", "grpo", "lm",
               "objectives", "registry")
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
  return registered(config.model).task_class().for_config(config)


def example_inputs(model_config: Any, method: str = "__call__") -> tuple:
  """Zeros of the shapes one call of the model's `method` takes (`Task.example_inputs`)."""
  return registered(model_config).task_class().example_inputs(model_config, method)


__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS, renamed={
    "FAMILIES": f"{__name__}.REGISTRY", "Family": f"{__name__}.RegisteredTask",
    "family": f"{__name__}.registered"})


__all__ = [
    "REGISTRY", "Batch", "CustomTask", "ImageClassification", "LanguageModel", "LossFn",
    "QuantLayers", "RegisteredTask", "Task",
    "classification_loss", "example_inputs", "for_config", "lm_loss", "registered", "resolve",
]
