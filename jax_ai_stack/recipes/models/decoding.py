"""Sampling from a `Decoder` with its KV cache: `generate`, one jitted loop.

Example:
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig
  >>> model = Decoder(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  >>> tokens = generate(model, jnp.array([[256, 104, 105]]), 4, temperature=0,
  ...                   rng=jax.random.key(0))
  >>> tokens.shape, tokens[0, :3].tolist()
  ((1, 7), [256, 104, 105])
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.recipes.models.decoder import Decoder, _check_tokens


def generate(
    model: Decoder,
    prompt_tokens: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: jax.Array,
) -> jax.Array:
  """Samples `max_new_tokens` after each prompt row, with a KV cache.

  The whole loop (prefill, then one cached step per token) is one jitted call
  over a cache of the model's full `max_seq_len`, so it compiles once per
  (model structure, prompt shape, top_k, top_p): the number of new tokens,
  the temperature and rng are traced, and changing them does not recompile
  (nor re-tune a kernel). The price: each decoding step attends over the
  whole cache, masked past the tokens written so far.

  Args:
    model: the decoder; it is not modified.
    prompt_tokens: int [B, P], P >= 1; every row has the same length.
    max_new_tokens: tokens to add; P + max_new_tokens <= config.max_seq_len.
    temperature: softmax temperature; 0 picks the most likely token (greedy).
    top_k: sample among the k most likely tokens only; None: all of them.
    top_p: sample among the most likely tokens whose probabilities add up to
      `top_p` (nucleus sampling, 0 < top_p <= 1); None: all of them.
    rng: a PRNG key; the same key gives the same tokens.

  Returns:
    int32 [B, P + max_new_tokens]: the prompt followed by the new tokens.
  """
  prompt_tokens = jnp.asarray(prompt_tokens)
  _check_tokens(prompt_tokens)
  config = model.config
  batch, prompt_len = prompt_tokens.shape
  if prompt_len < 1:
    raise ValueError("prompt_tokens must hold at least one token per row")
  if max_new_tokens < 0:
    raise ValueError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
  if prompt_len + max_new_tokens > config.max_seq_len:
    raise ValueError(
        f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds "
        f"max_seq_len={config.max_seq_len} of the model config"
    )
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0; got {temperature}")
  if top_k is not None and not 1 <= top_k <= config.vocab_size:
    raise ValueError(f"top_k must be in [1, vocab_size={config.vocab_size}]; got {top_k}")
  if top_p is not None and not 0 < top_p <= 1:
    raise ValueError(f"top_p must be in (0, 1]; got {top_p}")
  prompt_tokens = prompt_tokens.astype(jnp.int32)
  if max_new_tokens == 0:
    return prompt_tokens
  graphdef, state = nnx.split(model)
  new_tokens = _generate(
      graphdef, state, prompt_tokens, rng, jnp.float32(temperature), jnp.int32(max_new_tokens),
      top_k=top_k, top_p=top_p,
  )
  return jnp.concatenate([prompt_tokens, new_tokens[:, :max_new_tokens]], axis=1)


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "top_p"))
def _generate(graphdef, state, prompt, rng, temperature, max_new_tokens, *, top_k, top_p):
  """New tokens [B, max_seq_len - P]; those past `max_new_tokens` (traced) stay 0."""
  model = nnx.merge(graphdef, state)
  batch, prompt_len = prompt.shape
  cache = model.init_cache(batch, model.config.max_seq_len)
  logits, cache = model.decode(prompt, cache, logits_at=jnp.full((batch,), prompt_len - 1))
  first = _sample(logits[:, -1], jax.random.fold_in(rng, 0), temperature, top_k, top_p)
  room = model.config.max_seq_len - prompt_len
  new_tokens = jnp.zeros((batch, room), jnp.int32).at[:, 0].set(first)

  def step(i, carry):
    # The state rides in the carry, so the loop body builds its own module:
    # nnx.scan (scan_layers) refuses Variables made at an outer trace level.
    new_tokens, cache, state = carry
    logits, cache = nnx.merge(graphdef, state).decode(new_tokens[:, i - 1, None], cache)
    token = _sample(logits[:, -1], jax.random.fold_in(rng, i), temperature, top_k, top_p)
    return new_tokens.at[:, i].set(token), cache, state

  new_tokens, _, _ = jax.lax.fori_loop(1, max_new_tokens, step, (new_tokens, cache, state))
  return new_tokens


def _sample(logits, key, temperature, top_k, top_p):
  """One token per row from float32 logits [B, V]; greedy when temperature == 0."""
  if top_k is not None:
    kth_largest = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
  greedy = jnp.argmax(logits, axis=-1)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
  if top_p is not None:  # Keep the smallest set of likeliest tokens whose mass reaches top_p.
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    mass_before = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) - jax.nn.softmax(
        ordered, axis=-1)
    kept = jnp.where(mass_before < top_p, ordered, jnp.inf).min(axis=-1, keepdims=True)
    scaled = jnp.where(scaled < kept, -jnp.inf, scaled)
  sampled = jax.random.categorical(key, scaled, axis=-1)
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)
