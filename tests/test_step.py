"""The shared train step: micro-batches accumulate to the whole batch's step."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ai_stack.recipes import step
from jax_ai_stack.recipes.models.cnn import CNN, CNNConfig
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
from jax_ai_stack.recipes.tasks import classification_loss
from jax_ai_stack.recipes.tasks.objectives import lm_loss

LLAMA = DecoderConfig(vocab_size=259, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                    mlp_dim=64, max_seq_len=32)


def _lm_batch(rows=8, length=16):
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, 259, (rows, length)).astype(np.int32)
  segments = np.ones((rows, length), np.int32)
  segments[:3, 5:] = 0  # Padding in some rows only: micro-batches hold unequal token counts.
  return {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1), "segment_ids": segments,
          "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1))}


def _step(build, loss, batch, microbatch_size, steps=1):
  model = build()
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  train_step, _, state = step.make_steps(model, optimizer, loss, microbatch_size=microbatch_size)
  for _ in range(steps):
    state, metrics = train_step(state, batch)
  return jax.device_get(metrics), jax.device_get(state)


def test_micro_batches_weighted_by_tokens_give_the_whole_batch_step():
  build = lambda: Decoder(LLAMA, rngs=nnx.Rngs(0))
  whole, whole_state = _step(build, lm_loss, _lm_batch(), None, steps=2)
  micro, micro_state = _step(build, lm_loss, _lm_batch(), 2, steps=2)  # 4 micro-batches.
  assert micro["tokens"] == whole["tokens"] == 8 * 16 - 3 * 11
  np.testing.assert_allclose(micro["loss"], whole["loss"], rtol=1e-5)
  np.testing.assert_allclose(micro["grad_norm"], whole["grad_norm"], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(micro_state), jax.tree.leaves(whole_state)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_batch_no_larger_than_the_micro_batch_is_one_pass_with_the_same_bits():
  build = lambda: Decoder(LLAMA, rngs=nnx.Rngs(0))
  whole, whole_state = _step(build, lm_loss, _lm_batch(), None)
  same, same_state = _step(build, lm_loss, _lm_batch(), 8)
  assert whole == same
  assert all((a == b).all() for a, b in zip(jax.tree.leaves(whole_state),
                                           jax.tree.leaves(same_state)))


def test_micro_batches_without_a_token_count_weigh_equally_and_draw_fresh_dropout():
  rng = np.random.default_rng(1)
  batch = {"images": rng.normal(size=(8, 8, 8, 1)).astype(np.float32),
           "labels": rng.integers(0, 10, 8).astype(np.int32)}
  still = lambda: CNN(CNNConfig(dropout=0.0), rngs=nnx.Rngs(0))
  whole, _ = _step(still, classification_loss, batch, None)
  micro, _ = _step(still, classification_loss, batch, 2)
  np.testing.assert_allclose(micro["loss"], whole["loss"], rtol=1e-5)
  np.testing.assert_allclose(micro["accuracy"], whole["accuracy"], rtol=1e-6)
  dropping = lambda: CNN(CNNConfig(dropout=0.5), rngs=nnx.Rngs(0))
  draws = [_dropout_draws(_step(dropping, classification_loss, batch, size)[1])
           for size in (None, 2)]
  assert draws == [1, 4]  # Each micro-batch its own dropout mask, carried through the scan.


def _dropout_draws(state) -> int:
  """How often the model's dropout stream has been drawn from (its RNG counter)."""
  (count,) = [value for path, value in jax.tree_util.tree_flatten_with_path(state)[0]
              if "'dropout'" in jax.tree_util.keystr(path) and "count" in jax.tree_util.keystr(path)]
  return int(count)
