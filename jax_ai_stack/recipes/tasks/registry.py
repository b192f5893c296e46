"""The Task registry as a recipe config sees it: no jax, no Task yet.

A recipe config needs, of each registered Task, only the model config it trains
(tagged by `model.kind`) and the checks that tie that model to the rest of the
recipe. The Task, which builds models and datasets, imports jax, flax, optax and
grain; so a `RegisteredTask` names where its Task lives and imports it on first
use. The config then loads, validates and prints in a fraction of a second.

(A decoder "family" is a Hugging Face architecture, `models.hf.families`; a
"kind" is `model.kind`, which names one. Neither is a Task.)

Example:
  >>> from jax_ai_stack.recipes.models.cnn_config import CNNConfig
  >>> registered(CNNConfig()).task
  'jax_ai_stack.recipes.tasks.classification:ImageClassification'
"""

from __future__ import annotations

import dataclasses
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.models.cnn_config import CNNConfig
from jax_ai_stack.recipes.models.configs import (DECODER_PROJECTIONS, CustomModelConfig,
                                                 DecoderConfig)

if TYPE_CHECKING:
  from jax_ai_stack.recipes.tasks.base import Task


def _no_check(config: Any) -> None:
  del config


@dataclasses.dataclass(frozen=True)
class RegisteredTask:
  """One registered Task: the model config it trains, its recipe checks, where it lives."""

  model_config: type
  """The model config dataclass this Task trains (tagged by its `kind`)."""
  task: str
  """"module:Class" of its Task, imported by `task_class`."""
  check: Callable[[Any], None] = _no_check
  """Raises ValueError when the rest of a recipe config does not fit this Task."""
  lora_modules: str | None = None
  """The layers LoRA adapts by default (`finetune.lora.modules`): a regex of module
  names; None: none by default (a recipe must say which)."""

  @property
  def kind(self) -> str:
    """The `model.kind` of the default model config."""
    return self.model_config().kind

  @property
  def kinds(self) -> tuple[str, ...]:
    """Every `model.kind` that tags the model config (the decoder has one per
    architecture)."""
    return configlib.kinds(self.model_config)

  def task_class(self) -> type[Task]:
    """The `Task` subclass (imports its module: jax, flax, ...)."""
    return pkgutil.resolve_name(self.task)


def _check_language_model(config: Any) -> None:
  if not (config.data.is_token_source or config.data.is_prompts):
    raise ValueError(
        f"model.kind={config.model.kind!r} does not go with data.source={config.data.source!r}: "
        "a decoder reads token corpora (stdlib, text, npy, arrayrecord, parquet), "
        "conversations, preference pairs or prompts"
    )
  if config.data.is_preference and config.finetune.base is None:
    raise ValueError(
        f"data.source={config.data.source!r} trains DPO, whose reference model is the base "
        "the run starts from: set finetune.base (with finetune.lora the reference is the "
        "base with its adapters off; without, a frozen copy of the base)")
  if config.data.is_prompts and config.rl.beta > 0 and config.finetune.base is None:
    raise ValueError(
        f"rl.beta={config.rl.beta} penalises the distance to the reference, the base the run "
        "starts from: set finetune.base, or rl.beta=0")
  if config.data.seq_len > config.model.max_seq_len:
    raise ValueError(
        f"data.seq_len={config.data.seq_len} exceeds model.max_seq_len={config.model.max_seq_len}"
    )
  moe, expert = config.model.moe, config.mesh.expert
  if moe is not None and expert > 1 and moe.num_experts % expert:
    raise ValueError(
        f"mesh.expert={expert} does not divide model.moe.num_experts={moe.num_experts}: "
        "each device of the expert axis holds the same number of experts")


def _check_image_classification(config: Any) -> None:
  if config.data.source != "digits":
    raise ValueError(
        f"model.kind='cnn' does not go with data.source={config.data.source!r}: "
        "cnn reads the digits images"
    )


def _check_custom(config: Any) -> None:
  if config.data.batch_schedule and not config.data.is_token_source:
    raise ValueError(f"data.batch_schedule: with data.source={config.data.source!r} the batches "
                     "come from your Task's `dataset`, which sets their size")


REGISTRY: tuple[RegisteredTask, ...] = (
    RegisteredTask(DecoderConfig, "jax_ai_stack.recipes.tasks.lm:LanguageModel",
                   _check_language_model, lora_modules=DECODER_PROJECTIONS),
    RegisteredTask(CNNConfig, "jax_ai_stack.recipes.tasks.classification:ImageClassification",
                   _check_image_classification),
    RegisteredTask(CustomModelConfig, "jax_ai_stack.recipes.tasks.custom:CustomTask",
                   _check_custom),
)
"""Every Task a recipe config can name (by its model); the first is the default."""


def registered(model_config: Any) -> RegisteredTask:
  """The registered Task whose model config `model_config` is."""
  for candidate in REGISTRY:
    if isinstance(model_config, candidate.model_config):
      return candidate
  raise TypeError(f"no Task trains a {type(model_config).__name__}; known: "
                  + ", ".join(entry.model_config.__name__ for entry in REGISTRY))
