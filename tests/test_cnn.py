"""Tests of the CNN classifier: shapes, counts, dropout modes, fit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ai_stack.recipes.models import cnn
from jax_ai_stack.recipes.models.cnn import CNN, CNNConfig


def count_params(model) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_logits_shape_dtype_and_param_count():
  config = CNNConfig()
  model = CNN(config, rngs=nnx.Rngs(0))
  logits = model(jnp.ones((4, 8, 8, 1)))
  assert logits.shape == (4, 10) and logits.dtype == jnp.float32
  # conv 3x3: 1 -> 16 -> 32 channels; two 2x2 pools: 8x8 -> 2x2; dense 128 -> 64 -> 10.
  expected = (9 * 1 * 16 + 16) + (9 * 16 * 32 + 32) + (2 * 2 * 32 * 64 + 64) + (64 * 10 + 10)
  assert count_params(model) == expected
  assert config.flat_features == 2 * 2 * 32


def test_other_shapes_and_bfloat16_compute():
  config = CNNConfig(image_shape=(16, 24, 3), channels=(8, 8, 4), num_classes=5, dtype="bfloat16")
  model = nnx.eval_shape(lambda: CNN(config, rngs=nnx.Rngs(0)))
  images = jax.ShapeDtypeStruct((2, 16, 24, 3), jnp.float32)
  logits = jax.eval_shape(lambda m, x: m(x), model, images)
  assert logits.shape == (2, 5) and logits.dtype == jnp.float32
  assert model.hidden.kernel.shape == (2 * 3 * 4, 64)  # 16x24 halved three times


def test_dropout_only_in_training_mode():
  model = CNN(CNNConfig(dropout=0.5), rngs=nnx.Rngs(0))
  images = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
  assert not np.array_equal(model(images), model(images))  # fresh dropout mask per call
  model.eval()
  np.testing.assert_array_equal(model(images), model(images))
  no_dropout = CNN(CNNConfig(dropout=0.0), rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(no_dropout(images), model(images))  # eval == no dropout


def test_every_param_has_logical_axis_names():
  model = nnx.eval_shape(lambda: CNN(CNNConfig(), rngs=nnx.Rngs(0)))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata().get("out_sharding")
    assert names is not None and len(names) == var.ndim, path
    assert set(names) - {None} <= set(cnn.LOGICAL_AXES), (path, names)
  assert model.convs[0].kernel.get_metadata()["out_sharding"] == (
      None, None, "conv_in", "conv_out"
  )


def test_wrong_image_shape_is_named():
  model = nnx.eval_shape(lambda: CNN(CNNConfig(), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"images must be \[batch, 8, 8, 1\].*got \[4, 8, 8\]"):
    model(jnp.ones((4, 8, 8)))


def test_learns_to_tell_bars_apart():
  # Horizontal vs vertical bars at random rows/columns, with noise.
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 2, size=64)
  images = rng.normal(0.0, 0.3, size=(64, 8, 8, 1)).astype(np.float32)
  for image, label, where in zip(images, labels, rng.integers(0, 8, size=64)):
    if label:
      image[:, where] += 1.0
    else:
      image[where, :] += 1.0
  config = CNNConfig(num_classes=2, dropout=0.0)
  model = CNN(config, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  def loss_fn(model, images, labels):
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @nnx.jit
  def step(model, optimizer, images, labels):
    loss, grads = nnx.value_and_grad(loss_fn)(model, images, labels)
    optimizer.update(model, grads)
    return loss

  for _ in range(40):
    step(model, optimizer, images, labels)
  model.eval()
  accuracy = float((jnp.argmax(model(images), axis=-1) == labels).mean())
  assert accuracy > 0.95
