"""The CNN classifier's config: its shapes and numerics, readable without jax.

Example:
  >>> CNNConfig(channels=(8, 8, 8)).flat_features
  8
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import PositiveInt

from jax_ai_stack.recipes.configlib import config_dataclass
from jax_ai_stack.recipes.models.configs import DType


@config_dataclass
class CNNConfig:
  """Shapes of the CNN classifier. The defaults fit 8x8 grey digits."""

  kind: Literal["cnn"] = "cnn"
  """Model family; tells model configs apart in a recipe."""
  num_classes: PositiveInt = 10
  """Number of classes, the width of the logits."""
  image_shape: tuple[PositiveInt, PositiveInt, PositiveInt] = (8, 8, 1)
  """(height, width, channels) of one input image."""
  channels: tuple[PositiveInt, ...] = (16, 32)
  """Output channels of each conv layer; each layer halves height and width."""
  kernel_size: PositiveInt = 3
  """Height and width of every conv kernel."""
  hidden: PositiveInt = 64
  """Units of the dense layer before the classifier."""
  dropout: Annotated[float, pydantic.Field(ge=0.0, lt=1.0)] = 0.1
  """Fraction of hidden units dropped in training mode."""
  dtype: DType = "float32"
  """Compute dtype; logits are always float32."""
  param_dtype: DType = "float32"
  """Storage dtype of the parameters."""

  def __post_init__(self):
    if not self.channels:
      raise ValueError("channels must name at least one conv layer; got ()")
    shrink = 2 ** len(self.channels)
    height, width, _ = self.image_shape
    if height % shrink or width % shrink:
      raise ValueError(
          f"image_shape={self.image_shape}: height and width must be divisible by "
          f"{shrink}, since each of the {len(self.channels)} conv layers in "
          f"channels={self.channels} halves them"
      )

  @property
  def flat_features(self) -> int:
    """Features after the last pool, fed to the dense layer."""
    height, width, _ = self.image_shape
    shrink = 2 ** len(self.channels)
    return (height // shrink) * (width // shrink) * self.channels[-1]
