"""A small CNN image classifier in Flax NNX: recipes are not only for LMs.

Per entry of `channels`: 3x3 conv -> ReLU -> 2x2 average pool (halving height
and width); then flatten -> dense -> ReLU -> dropout -> dense to class logits.
Sized for scikit-learn's 8x8 digits, the `digits` preset's data.

Dropout follows the NNX mode: `model.train()` (the default) drops units with
the module's own `dropout` RNG stream; `model.eval()` turns it off.

Logical axis names, one per parameter dimension (via `nnx.with_partitioning`):

  conv_in   input channels of a conv kernel (its two spatial axes are None)
  conv_out  output channels of a conv kernel, and its bias
  embed     the flattened features fed to the dense layers
  mlp       hidden units of the dense layer
  classes   class logits

Example:
  >>> from flax import nnx
  >>> model = CNN(CNNConfig(), rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((4, 8, 8, 1))).shape
  (4, 10)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.recipes.models import eager_sharding_scope
# The config lives in `cnn_config` (no jax), for recipe configs to load cheaply; re-exported.
from jax_ai_stack.recipes.models.cnn_config import CNNConfig  # noqa: F401

LOGICAL_AXES = ("conv_in", "conv_out", "embed", "mlp", "classes")


class CNN(nnx.Module):
  """Images float32 [B, H, W, C] -> float32 logits [B, num_classes]."""

  def __init__(self, config: CNNConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    conv_init = nnx.initializers.lecun_normal()
    with eager_sharding_scope():
      in_channels = (config.image_shape[-1], *config.channels[:-1])
      self.convs = nnx.List([
          nnx.Conv(
              c_in, c_out, (config.kernel_size, config.kernel_size), rngs=rngs, **dtypes,
              kernel_init=nnx.with_partitioning(conv_init, (None, None, "conv_in", "conv_out")),
              bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("conv_out",)),
          )
          for c_in, c_out in zip(in_channels, config.channels)
      ])
      self.hidden = nnx.Linear(
          config.flat_features, config.hidden, rngs=rngs, **dtypes,
          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
          bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
      )
      self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
      self.classifier = nnx.Linear(
          config.hidden, config.num_classes, rngs=rngs, **dtypes,
          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("mlp", "classes")),
          bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("classes",)),
      )

  def __call__(self, images: jax.Array) -> jax.Array:
    if images.ndim != 4 or tuple(images.shape[1:]) != tuple(self.config.image_shape):
      raise ValueError(
          f"images must be [batch, {', '.join(map(str, self.config.image_shape))}] "
          f"(config.image_shape); got {list(images.shape)}"
      )
    x = images
    for conv in self.convs:
      x = nnx.avg_pool(nnx.relu(conv(x)), window_shape=(2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = self.dropout(nnx.relu(self.hidden(x)))
    return self.classifier(x).astype(jnp.float32)
