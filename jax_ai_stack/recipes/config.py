"""The recipe config: one frozen tree of every setting a training job needs.

A recipe is a YAML preset (`presets/<name>.yaml`, listed by
`jax-ai-stack train --list`), optionally merged with a user YAML file, then
dotted overrides (`model.num_layers=6` or `--model.num_layers 6`). The result is
validated into `RecipeConfig`; errors name the field, the value and the source.

Example:
  >>> config = load("lm-tiny", overrides=["train.steps=10"])
  >>> config.train.steps, config.model.kind
  (10, 'llama')
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib
from typing import Annotated, Literal, Union

import pydantic

from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.checkpoint import CheckpointConfig
from jax_ai_stack.recipes.configlib import ConfigError, config_dataclass
from jax_ai_stack.recipes.data import DataConfig
from jax_ai_stack.recipes.models.cnn import CNNConfig
from jax_ai_stack.recipes.models.llama import LlamaConfig
from jax_ai_stack.recipes.optim import OptimConfig

DEFAULT_PRESET = "lm-tiny"

ModelConfig = Annotated[Union[LlamaConfig, CNNConfig], pydantic.Field(discriminator="kind")]


@config_dataclass
class TrainConfig:
  steps: int = 500
  """Optimizer steps to train for."""
  seed: int = 0
  """Seeds parameters, dropout and the data order: same seed, same bits."""
  eval_every: int = 100
  """Evaluate on the validation split every this many steps (and at the end)."""
  eval_batches: int = 4
  """Validation batches per evaluation (the same ones every time)."""
  resume: Literal["auto", "never"] = "auto"
  """auto: continue from the newest checkpoint in the workdir; never: refuse a workdir that has one."""
  sample_prompt: str = "def "
  """LM recipes: the prompt of the sample generated at the end."""
  sample_tokens: int = 128
  """LM recipes: tokens generated for the sample."""
  sample_temperature: float = 0.8
  """LM recipes: sampling temperature of the sample (0: greedy)."""
  progress: bool = True
  """Show a progress bar (step, loss, throughput, ETA) on stderr."""
  autotune_attention: bool = False
  """Tune attention once (tokamax.autotune + timing) and pin the choice in
  <workdir>/attention_autotune.json; resume reloads it so numerics do not change."""

  def __post_init__(self):
    for name in ("steps", "eval_every", "eval_batches"):
      if getattr(self, name) < 1:
        raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
    if self.sample_tokens < 0:
      raise ValueError(f"train.sample_tokens must be >= 0, got {self.sample_tokens}")


@config_dataclass
class RecipeConfig:
  name: str = "custom"
  """The preset this config came from (names the default workdir runs/<name>)."""
  model: ModelConfig = dataclasses.field(default_factory=LlamaConfig)
  """The model: `kind: llama` (decoder LM) or `kind: cnn` (image classifier)."""
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  """Optimizer, schedule, clipping, weight decay, accumulation."""
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  """Corpus or data set, tokenizer, sequence length, global batch size."""
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  """How often to save and what to keep."""
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  """Steps, seed, evaluation, resume, the final sample."""

  def __post_init__(self):
    is_lm = isinstance(self.model, LlamaConfig)
    if is_lm == (self.data.source == "digits"):
      raise ValueError(
          f"model.kind={self.model.kind!r} does not go with data.source={self.data.source!r}: "
          "llama reads token corpora, cnn reads the digits images"
      )
    if is_lm and self.data.seq_len > self.model.max_seq_len:
      raise ValueError(
          f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
      )


def _presets_dir() -> pathlib.Path:
  return pathlib.Path(str(importlib.resources.files("jax_ai_stack.recipes") / "presets"))


def list_presets() -> list[str]:
  return sorted(p.stem for p in _presets_dir().glob("*.yaml"))


def _merge(base: dict, update: dict) -> dict:
  out = dict(base)
  for key, value in update.items():
    if isinstance(value, dict) and isinstance(out.get(key), dict):
      out[key] = _merge(out[key], value)
    else:
      out[key] = value
  return out


def load(
    preset: str | None = DEFAULT_PRESET,
    *,
    config_file: str | pathlib.Path | None = None,
    overrides: list[str] = (),
) -> RecipeConfig:
  """Preset, then `config_file` merged over it, then dotted overrides; validated."""
  data: dict = {}
  sources = []
  if preset is not None:
    path = _presets_dir() / f"{preset}.yaml"
    if not path.is_file():
      raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(list_presets())}")
    data = _merge(configlib.load_yaml(path), {"name": preset})
    sources.append(f"preset {preset}")
  if config_file is not None:
    data = _merge(data, configlib.load_yaml(config_file))
    sources.append(str(config_file))
  if overrides:
    data = configlib.apply_overrides(data, list(overrides))
    sources.append("overrides " + " ".join(overrides))
  return configlib.from_dict(RecipeConfig, data, source=" + ".join(sources) or "config")


def from_json(data: dict) -> RecipeConfig:
  """A config saved in checkpoint metadata, validated again."""
  return configlib.from_dict(RecipeConfig, data, source="checkpoint metadata")
