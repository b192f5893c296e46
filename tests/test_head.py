"""The output head's log-probabilities in chunks: the unchunked values and gradients, and a
one-matmul head's backward pass that tiles the vocabulary holds no [D, V] per chunk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.head import LinearHead, linear_target_logps, target_logps
from jax_ai_stack.recipes.models.decoder import Decoder


def _unchunked(logits_of, x, targets):
  return -optax.softmax_cross_entropy_with_integer_labels(logits_of(x), targets)


def _close(a, b, tolerance):
  """Within `tolerance` of b's largest entry (the benchmark's measure)."""
  assert np.abs(np.asarray(a) - np.asarray(b)).max() <= tolerance * np.abs(np.asarray(b)).max()


def _agrees_with_unchunked(loss, x, weight, grads_close):
  """`loss(x, weight, chunked)` compiled chunked against the unchunked eagerly: the loss within
  1e-6 relative, each gradient as `grads_close(chunked, unchunked)` asserts; the chunked
  gradients."""
  want, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(x, weight, False)
  got, got_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
      x, weight, True)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for a, b in zip(got_grads, want_grads):
    grads_close(a, b)
  return got_grads


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

  _agrees_with_unchunked(loss, x, head,
                         lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6))




@pytest.mark.parametrize("vocab_major, softcap, padding, tile", [
    (False, None, 0, 16),  # A dense head's kernel [D, V], tiles that divide V.
    (True, 30.0, 0, 16),  # A tied embedding [V, D], Gemma's soft cap.
    (False, 5.0, 6, 24),  # Padding rows past vocab_size; a last tile that overlaps.
    (True, None, 6, 500),  # One tile wider than the vocabulary.
])
def test_the_tiled_backward_gives_the_unchunked_logps_and_gradients(vocab_major, softcap,
                                                                    padding, tile):
  keys = jax.random.split(jax.random.key(0), 3)
  vocab = 50
  x = jax.random.normal(keys[0], (2, 23, 16))
  shape = (vocab + padding, 16) if vocab_major else (16, vocab + padding)
  weight = jax.random.normal(keys[1], shape)
  targets = jax.random.randint(keys[2], (2, 23), 0, vocab)
  weights = jnp.linspace(0.0, 1.0, 46).reshape(2, 23)
  head = LinearHead(vocab, jnp.float32, softcap, vocab_major=vocab_major)

  def loss(x, weight, tiled):
    if tiled:
      logps = linear_target_logps(head, x, weight, targets, 7, vocab_tile=tile)
    else:
      logits = head.logits(x.reshape(-1, 16), weight).reshape(2, 23, vocab)
      logps = -optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (logps * weights).sum()

  got_grads = _agrees_with_unchunked(loss, x, weight, lambda a, b: _close(a, b, 1e-5))
  padded = got_grads[1][vocab:] if vocab_major else got_grads[1][:, vocab:]
  assert not np.asarray(padded).any()  # No token: no gradient, so AdamW keeps them zero.


def test_the_tiled_backward_holds_no_weight_gradient_per_chunk():
  """XLA's temporaries of loss + gradient: the generic chunks make each chunk's [D, V] weight
  gradient whole before adding it; the tiles add each tile's columns in place."""
  d, vocab, b, t = 64, 16_384, 2, 64
  x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  weight = jax.ShapeDtypeStruct((d, vocab), jnp.float32)
  targets = jax.ShapeDtypeStruct((b, t), jnp.int32)
  head = LinearHead(vocab, jnp.float32)

  def temporaries(logps):
    step = jax.jit(jax.value_and_grad(lambda x, w, t: logps(x, w, t).sum(), argnums=(0, 1)))
    return step.lower(x, weight, targets).compile().memory_analysis().temp_size_in_bytes

  generic = temporaries(lambda x, w, t: target_logps(lambda h: h @ w, x, t, 8))
  tiled = temporaries(lambda x, w, t: linear_target_logps(head, x, w, t, 8, vocab_tile=1024))
  weight_bytes = d * vocab * 4
  assert generic > weight_bytes > 2 * tiled, (generic, tiled, weight_bytes)


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
    # The chunks sum the head's gradient in another order: an entry of 8 (the embedding's)
    # moves by ~3e-6, past an absolute 1e-6.
    _close(a, b, 1e-5)


def test_lora_adapters_on_the_head_go_through_the_generic_chunks():
  """Qwix adds a head's adapters inside its call, which the one-matmul backward pass would
  skip: with adapters on lm_head the decoder takes `target_logps`, and they train."""
  from jax_ai_stack.recipes.finetune import adapters
  from jax_ai_stack.recipes.finetune.config import LoraConfig

  config = DecoderConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                         mlp_dim=64, max_seq_len=64, tie_embeddings=False)
  model = adapters.add_adapters(Decoder(config, rngs=nnx.Rngs(0)),
                                LoraConfig(rank=2, modules="lm_head"), config, seed=1)
  for path, node in nnx.iter_graph(model):  # B away from zero: the adapters change logits.
    if isinstance(node, nnx.LoRAParam) and str(path[-1]).endswith(adapters.B_SUFFIX):
      node.set_value(jnp.full_like(node.get_value(), 0.1))
  tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, 64)
  targets = jax.random.randint(jax.random.key(2), (2, 21), 0, 64)
  logits = nnx.jit(lambda m: m(tokens))(model)
  want = jax.nn.log_softmax(logits)[jnp.arange(2)[:, None], jnp.arange(21), targets]
  got = nnx.jit(lambda m: m(tokens, targets=targets, chunk_tokens=5))(model)
  np.testing.assert_allclose(got, want, atol=2e-5)
  grads = nnx.grad(lambda m: m(tokens, targets=targets, chunk_tokens=5).sum(),
                   argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
  assert all(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
