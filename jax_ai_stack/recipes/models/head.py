"""The output head's log-probabilities of given tokens, over the sequence in chunks.

A loss needs log softmax(logits)[target] at each position, not the logits: at
Gemma 3's 262,144-token vocabulary the float32 logits of one 4,096-token
sequence are 4.3 GB, and their gradient as much again, so fine-tuning a real
model on one accelerator is bounded by the loss rather than the model.
`target_logps` makes the logits a chunk of positions at a time and drops them;
the backward pass makes each chunk again instead of keeping it. Autodiff then
still makes, for each chunk, the head's whole weight gradient [D, V] before
adding it up (1.2 GB at Gemma's vocabulary); for a head that is one matmul
(the decoder's, `LinearHead`), `linear_target_logps` has a backward pass of its
own that goes over the vocabulary in tiles and adds each tile's columns in
place (the vocabulary tiling of Levanter and MaxText).
`python benchmarks/chunked_loss.py` measures the memory and time against the
unchunked loss.

Example:
  >>> import jax.numpy as jnp
  >>> head = lambda x: x @ jnp.eye(4)  # Hidden states as logits over 4 tokens.
  >>> x = jnp.arange(2 * 6 * 4, dtype=jnp.float32).reshape(2, 6, 4) / 10
  >>> targets = jnp.zeros((2, 6), jnp.int32)
  >>> bool(jnp.allclose(target_logps(head, x, targets, 4), target_logps(head, x, targets, 6)))
  True
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jax_ai_stack.recipes.models.layers import on_tokens

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

  return over_positions(logps, (x, targets), chunk_tokens)


def over_positions(per_chunk: Callable[..., Any], arrays: tuple[jax.Array, ...],
                   chunk_tokens: int) -> Any:
  """`per_chunk(*arrays)` for arrays [B, T, ...] with the same T, computed `chunk_tokens`
  positions at a time, each chunk's intermediates (its logits) dropped and made again in
  the backward pass (`jax.checkpoint`); its outputs [B, chunk, ...] joined back to [B, T,
  ...]. What makes a loss over the vocabulary cost one chunk's logits, not the sequence's:
  `target_logps`, and a distillation loss over two models' heads."""
  t = arrays[0].shape[1]
  if t <= chunk_tokens:
    return per_chunk(*arrays)
  out = jax.lax.map(lambda chunk: jax.checkpoint(per_chunk)(*chunk),
                    tuple(_chunked(a, chunk_tokens) for a in arrays))
  return jax.tree.map(lambda y: _unchunked(y, t), out)


VOCAB_TILE = 8192
"""Vocabulary entries per tile of `linear_target_logps`' backward pass: a [B, chunk, 8192]
float32 block is 8 MB a row of 256 positions, whatever the vocabulary."""


@dataclasses.dataclass(frozen=True)
class LinearHead:
  """A head that is one matmul: logits = hidden @ weight ([D, V] a dense layer's kernel, or
  [V, D] with `vocab_major`, a tied embedding table), in `dtype`; the first `vocab_size`
  columns kept (the rest are vocabulary padding), then float32 and an optional soft cap."""

  vocab_size: int
  dtype: Any
  softcap: float | None = None
  vocab_major: bool = False

  def logits(self, hidden: jax.Array, weight: jax.Array) -> jax.Array:
    """Float32 logits [N, vocab_size] of hidden [N, D], as the decoder's own head computes
    them (`nnx.Linear` or `nnx.Embed.attend` on a [tokens, D] matrix)."""
    return self._capped(self._raw(hidden, weight)[:, :self.vocab_size].astype(jnp.float32))[0]

  @property
  def vocab_axis(self) -> int:
    """The weight's vocabulary axis."""
    return 0 if self.vocab_major else 1

  def _raw(self, hidden, weight):
    """hidden @ weight (all of its columns, or a tile of them) in `dtype`: [N, columns]."""
    hidden, weight = hidden.astype(self.dtype), weight.astype(self.dtype)
    return jnp.dot(hidden, weight.T) if self.vocab_major else jnp.dot(hidden, weight)

  def _capped(self, logits):
    """(cap * tanh(logits / cap), tanh(logits / cap)) with a soft cap; (logits, None) without."""
    if self.softcap is None:
      return logits, None
    tanh = jnp.tanh(logits / self.softcap)
    return self.softcap * tanh, tanh


def linear_target_logps(head: LinearHead, hidden: jax.Array, weight: jax.Array,
                        targets: jax.Array, chunk_tokens: int,
                        vocab_tile: int = VOCAB_TILE) -> jax.Array:
  """`target_logps` of a one-matmul head, with a backward pass that never holds a whole
  row of the vocabulary nor a whole [D, V] gradient per chunk.

  The forward pass is `target_logps`' (equal up to the order of the softmax's sums: the
  vocabulary padding is masked, not sliced off, which would copy the logits). Autodiff of
  it would, for each chunk, make the head's weight gradient [D, V] whole and then add it
  to the sum (XLA:CPU does not add inside the matmul): at Gemma's vocabulary that is
  1.2 GB beside the gradient itself. The backward pass here goes over the chunks and,
  in each, over tiles of `vocab_tile` vocabulary entries: it makes the chunk's logits
  of one tile again, and adds that tile's share to the hidden states' gradient and to
  its own columns of the weight's (vocabulary tiling, as Levanter and MaxText do).
  """
  if targets.shape[1] <= chunk_tokens:
    return target_logps(functools.partial(on_tokens, lambda h: head.logits(h, weight)), hidden,
                        targets, chunk_tokens)
  return _tiled(head, chunk_tokens, vocab_tile, hidden, weight, targets)


def _chunked(x: jax.Array, chunk: int) -> jax.Array:
  """[B, T, ...] -> [chunks, B, chunk, ...], the sequence padded with zeros to whole chunks."""
  b, t = x.shape[:2]
  n = -(-t // chunk)
  x = jnp.pad(x, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (x.ndim - 2))
  return x.reshape(b, n, chunk, *x.shape[2:]).swapaxes(0, 1)


def _unchunked(y: jax.Array, t: int) -> jax.Array:
  """[chunks, B, chunk, ...] -> [B, t, ...]."""
  n, b, c = y.shape[:3]
  return y.swapaxes(0, 1).reshape(b, n * c, *y.shape[3:])[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _tiled(head, chunk_tokens, vocab_tile, hidden, weight, targets):
  return _tiled_forward(head, chunk_tokens, vocab_tile, hidden, weight, targets)[0]


def _tiled_forward(head, chunk_tokens, vocab_tile, hidden, weight, targets):
  del vocab_tile

  def one(chunk):
    x, t = chunk
    x, t = x.reshape(-1, x.shape[-1]), t.reshape(-1)
    # Padding columns masked rather than sliced off: a slice would copy the chunk's logits.
    logits = head._capped(head._raw(x, weight).astype(jnp.float32))[0]
    if logits.shape[-1] > head.vocab_size:
      logits = jnp.where(jnp.arange(logits.shape[-1]) < head.vocab_size, logits, -jnp.inf)
    normalizer = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
    return (target - normalizer).reshape(chunk[1].shape), normalizer.reshape(chunk[1].shape)

  logps, normalizers = jax.lax.map(one, (_chunked(hidden, chunk_tokens),
                                         _chunked(targets, chunk_tokens)))
  t = targets.shape[1]
  return _unchunked(logps, t), (hidden, weight, targets, _unchunked(normalizers, t))


def _tiled_backward(head, chunk_tokens, vocab_tile, residuals, cotangent):
  hidden, weight, targets, normalizers = residuals
  axis = head.vocab_axis
  columns = weight.shape[axis]
  width = min(vocab_tile, columns)
  tiles = -(-columns // width)

  def chunk_grads(weight_grad, chunk):
    x, t, g, normalizer = (a.reshape(-1, *a.shape[2:]) for a in chunk)  # [rows, ...]
    x = x.astype(head.dtype)

    def tile_grads(j, carry):
      x_grad, weight_grad = carry
      start = jnp.minimum(j * width, columns - width)  # The last tile ends at the last column.
      column = start + jnp.arange(width)
      tile = jax.lax.dynamic_slice_in_dim(weight, start, width, axis).astype(head.dtype)
      logits, tanh = head._capped(head._raw(x, tile).astype(jnp.float32))
      probs = jnp.exp(logits - normalizer[:, None])
      # d logp / d logit = onehot - softmax; columns of a previous tile or of the padding: 0.
      grad = g[:, None] * ((column == t[:, None]) - probs)
      grad = jnp.where((column >= j * width) & (column < head.vocab_size), grad, 0.0)
      if tanh is not None:
        grad = grad * (1 - tanh * tanh)
      grad = grad.astype(head.dtype)
      x_grad += jnp.dot(grad, tile if head.vocab_major else tile.T,
                        preferred_element_type=jnp.float32)
      share = (jnp.dot(grad.T, x, preferred_element_type=jnp.float32) if head.vocab_major
               else jnp.dot(x.T, grad, preferred_element_type=jnp.float32))
      weight_grad = jax.lax.dynamic_update_slice_in_dim(
          weight_grad, jax.lax.dynamic_slice_in_dim(weight_grad, start, width, axis) + share,
          start, axis)
      return x_grad, weight_grad

    x_grad, weight_grad = jax.lax.fori_loop(
        0, tiles, tile_grads, (jnp.zeros(x.shape, jnp.float32), weight_grad))
    return weight_grad, x_grad.astype(hidden.dtype)

  chunks = (_chunked(hidden, chunk_tokens), _chunked(targets, chunk_tokens),
            _chunked(cotangent, chunk_tokens), _chunked(normalizers, chunk_tokens))
  weight_grad, x_grads = jax.lax.scan(chunk_grads, jnp.zeros(weight.shape, jnp.float32), chunks)
  b, c = hidden.shape[0], chunk_tokens
  x_grads = x_grads.reshape(x_grads.shape[0], b, c, hidden.shape[-1])
  return _unchunked(x_grads, hidden.shape[1]), weight_grad.astype(weight.dtype), None


_tiled.defvjp(_tiled_forward, _tiled_backward)
