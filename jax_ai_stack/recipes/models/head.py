"""The output head's log-probabilities of given tokens, over the sequence in chunks.

A loss needs log softmax(logits)[target] at each position, not the logits: at
Gemma 3's 262,144-token vocabulary the float32 logits of one 4,096-token
sequence are 4.3 GB, and their gradient as much again, so fine-tuning a real
model on one accelerator is bounded by the loss rather than the model.
`target_logps` makes the logits a chunk of positions at a time and drops them;
the backward pass makes each chunk again instead of keeping it (the vocabulary
tiling of Levanter and MaxText). `python benchmarks/chunked_loss.py` measures
the memory and time against the unchunked loss.

Example:
  >>> import jax.numpy as jnp
  >>> head = lambda x: x @ jnp.eye(4)  # Hidden states as logits over 4 tokens.
  >>> x = jnp.arange(2 * 6 * 4, dtype=jnp.float32).reshape(2, 6, 4) / 10
  >>> targets = jnp.zeros((2, 6), jnp.int32)
  >>> bool(jnp.allclose(target_logps(head, x, targets, 4), target_logps(head, x, targets, 6)))
  True
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

LOGPS_CHUNK_TOKENS = 256
"""Sequence positions per chunk of the head in `target_logps`: at Gemma's 262,144-token
vocabulary a [B, 256, V] float32 block of logits is 0.27 GB a row, not 4.3 GB per 4,096."""


def target_logps(logits_of: Callable[[jax.Array], jax.Array], x: jax.Array,
                 targets: jax.Array, chunk_tokens: int) -> jax.Array:
  """log softmax(logits_of(x))[targets], [B, T] float32, over the sequence in chunks.

  Each chunk's logits [B, chunk, V] are made, used and dropped; the backward pass makes
  them again (`jax.checkpoint`) rather than keeping them: the memory of the loss is one
  chunk's, not the sequence's (Levanter's and MaxText's vocabulary tiling). A sequence of
  at most `chunk_tokens` positions is one chunk, computed as the unchunked loss is.
  """
  def logps(x, targets):
    return -optax.softmax_cross_entropy_with_integer_labels(logits_of(x), targets)

  b, t = targets.shape
  if t <= chunk_tokens:
    return logps(x, targets)
  chunks = -(-t // chunk_tokens)
  pad = chunks * chunk_tokens - t
  x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, pad)))
  x = x.reshape(b, chunks, chunk_tokens, x.shape[-1]).swapaxes(0, 1)
  targets = targets.reshape(b, chunks, chunk_tokens).swapaxes(0, 1)
  out = jax.lax.map(lambda xt: jax.checkpoint(logps)(*xt), (x, targets))  # [chunks, B, c]
  return out.swapaxes(0, 1).reshape(b, chunks * chunk_tokens)[:, :t]
