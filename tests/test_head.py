"""The output head's log-probabilities in chunks: the unchunked values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.head import target_logps
from jax_ai_stack.recipes.models.decoder import Decoder


def _unchunked(logits_of, x, targets):
  return -optax.softmax_cross_entropy_with_integer_labels(logits_of(x), targets)


@pytest.mark.parametrize("chunk", [1, 4, 7, 23, 64])
def test_chunks_of_any_size_give_the_unchunked_logps_and_gradients(chunk):
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (2, 23, 16))
  head = jax.random.normal(keys[1], (16, 50))
  targets = jax.random.randint(keys[2], (2, 23), 0, 50)
  weights = jnp.linspace(0.0, 1.0, 46).reshape(2, 23)  # A mask-like weighting.

  def loss(x, head, chunked):
    logits_of = lambda h: h @ head  # noqa: E731
    logps = (target_logps(logits_of, x, targets, chunk) if chunked
             else _unchunked(logits_of, x, targets))
    return (logps * weights).sum()

  want, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(x, head, False)
  got, got_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
      x, head, True)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for a, b in zip(got_grads, want_grads):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma2"])  # Gemma 2: the final soft cap.
def test_the_model_s_target_logps_are_its_logits_log_softmax(kind):
  """Padded vocabulary rows stay out; one chunk is the unchunked computation, bit for bit."""
  model = Decoder(DecoderConfig(kind=kind, vocab_size=300, num_layers=1, d_model=32, num_heads=2,
                              num_kv_heads=1, mlp_dim=64, max_seq_len=64), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, 300)
  targets = jax.random.randint(jax.random.key(2), (2, 21), 0, 300)
  logits = model(tokens)
  assert logits.shape == (2, 21, 300)
  want = jax.nn.log_softmax(logits)[jnp.arange(2)[:, None], jnp.arange(21), targets]
  np.testing.assert_allclose(model(tokens, targets=targets, chunk_tokens=5), want, atol=2e-5)
  assert jnp.array_equal(model(tokens, targets=targets), _unchunked(lambda x: x, logits, targets))

  def loss(model, chunk):
    return model(tokens, targets=targets, chunk_tokens=chunk).sum()

  one = nnx.grad(lambda m: loss(m, 64))(model)
  chunked = nnx.grad(lambda m: loss(m, 5))(model)
  for a, b in zip(jax.tree.leaves(nnx.state(chunked)), jax.tree.leaves(nnx.state(one))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
