"""The image-classification Task: a CNN on labelled images (the digits set).

Reports eval loss and accuracy and counts throughput in examples; it leaves no
artefact beyond the loss plot.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> task = ImageClassification(config.load("digits-cnn"))
  >>> task.items_per_step, task.throughput_unit
  (64, 'examples')
"""

from __future__ import annotations

import functools

from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes import data, sharding
from jax_ai_stack.recipes.models import adapting
from jax_ai_stack.recipes.models.cnn import CNN, CNNConfig
from jax_ai_stack.recipes.tasks import objectives
from jax_ai_stack.recipes.tasks.base import Task


class ImageClassification(Task):
  """Class logits from images, trained with cross-entropy."""

  model_config = CNNConfig
  throughput_unit = "examples"
  data_kind = "images"
  quant_layers = adapting.QUANT_LAYERS[CNNConfig]

  def build_model(self, seed: int, attention: kernels.AttentionPlan | None = None,
                  layout: sharding.Layout | None = None) -> CNN:
    del attention, layout  # No attention in a CNN; XLA places its small activations.
    return CNN(self.config.model, rngs=nnx.Rngs(params=seed, dropout=seed + 1))

  @functools.cached_property
  def objective(self) -> objectives.Classification:
    """What the model learns (`objectives`): the class, by cross-entropy."""
    return objectives.Classification()

  def loss(self, model, batch):
    return objectives.training_loss(self.objective)(model, batch)

  def evaluation(self, means: dict[str, float]) -> dict[str, float]:
    return self.objective.evaluation(means)

  def dataset(self, split: str, seed: int):
    return data.build_dataset(self.config.data, split=split, seed=seed)

  @property
  def items_per_step(self) -> int:
    return self.config.data.batch_size

  def batch_axes(self) -> dict[str, tuple[str, ...]]:
    return self.objective.batch_axes()
