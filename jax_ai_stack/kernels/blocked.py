"""Causal attention that skips the masked keys, in cache-sized pieces: plain XLA, for CPU.

A dense causal attention computes every logit and masks half of them away,
and on CPU it is bound less by its matmuls than by memory: each of softmax's
passes reads and writes [B, N, T, S] floats. Here the work is cut twice:

  * per (batch row, K/V head) slice, one at a time (`lax.map`), so a slice's
    logits stay in the CPU's cache between the matmul, the softmax passes and
    the next matmul (measured: this alone is most of the gain);
  * per query block [a, b), only the keys the block can see: [0, b) when
    causal, [a - w, b) with a local window w. The logits form a staircase
    along the diagonal, about (n + 1) / 2n of the square for n blocks.

Each block takes an exact softmax over its whole key range (one slice, so no
online softmax is needed). The backward is a `jax.custom_vjp` over the same
slices and staircase that recomputes the probabilities from the saved
log-sum-exp, so nothing of size T x S is kept between forward and backward.

The query blocks are a static Python loop: n block bodies are compiled, and n
is at most `MAX_BLOCKS`, which keeps compile time flat for long sequences.
The ops are plain XLA, without atomics: the same inputs give the same bits.
The loop over slices is not something XLA's SPMD partitioner splits, so
under a mesh the kernel runs on each device's shard (`sharded.per_shard`).

Example:
  >>> q = jnp.ones((1, 8, 2, 4)); k = v = jnp.ones((1, 8, 1, 4))
  >>> blocked_attention(q, k, v, causal=True, block_size=4).shape
  (1, 8, 2, 4)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

MAX_BLOCKS = 16
"""At most this many query blocks (compile time grows with their number)."""


def default_block_size(q_len: int) -> int:
  """Query rows per block: 64, larger where that would make more than `MAX_BLOCKS`.

  Measured on XLA:CPU, 2 cores, forward+backward (benchmarks/attention.py
  --block-sizes): on an idle machine 64 is 1.1x-1.2x faster than 128 at
  T 256 and 512 and 32 is slower (its matmuls are too small); under heavy
  load from other processes 128 was ahead instead.
  """
  return max(64, -(-q_len // MAX_BLOCKS))


def _blocks(q_len: int, kv_len: int, block_size: int, causal: bool, window: int | None):
  """Static (start, stop, lo, hi) per query block: queries [start, stop) see keys [lo, hi)."""
  blocks = []
  for start in range(0, q_len, block_size):
    stop = min(start + block_size, q_len)
    lo = 0 if window is None else max(0, start - window)
    hi = stop if (causal or window is not None) else kv_len
    blocks.append((start, stop, min(lo, kv_len), min(hi, kv_len)))
  return tuple(blocks)


def _position_mask(block, causal: bool, window: int | None) -> np.ndarray | None:
  """[t, s] booleans: which keys of the block each query may see; None: all of them."""
  start, stop, lo, hi = block
  i, j = np.arange(start, stop)[:, None], np.arange(lo, hi)[None, :]
  allowed = np.ones((stop - start, hi - lo), bool)
  if causal or window is not None:
    allowed &= j <= i
  if window is not None:
    allowed &= j >= i - window
  return None if allowed.all() else allowed


def _capped(s, cap):
  """cap * tanh(s / cap) (the soft cap), and its derivative; s itself without a cap."""
  if cap is None:
    return s, None
  t = jnp.tanh(s / cap)
  return cap * t, 1.0 - t * t


def _logits(q, k, ids, block, mask, cap=None):
  """Masked logits [G, t, s] (float32) of one block of one slice, q [G, T, H] pre-scaled;
  with a soft `cap`, also d(capped)/d(raw) [G, t, s] (None without)."""
  start, stop, lo, hi = block
  s = jnp.einsum("gth,sh->gts", q[:, start:stop], k[lo:hi], preferred_element_type=jnp.float32)
  s, slope = _capped(s, cap)
  allowed = None if mask is None else jnp.asarray(mask)
  if ids is not None:
    same = ids[start:stop, None] == ids[None, lo:hi]
    allowed = same if allowed is None else allowed & same
  return (s if allowed is None else jnp.where(allowed[None], s, -jnp.inf)), slope


def _slice_forward(q, k, v, ids, sinks, blocks, masks, cap):
  """One (batch row, K/V head): (out [G, T, H], logsumexp [G, T] float32); `sinks` [G] (or
  None): a logit per query head in each softmax's denominator, with no value."""
  outs, lses = [], []
  sink = None if sinks is None else sinks.astype(jnp.float32)[:, None, None]
  for block, mask in zip(blocks, masks):
    start, stop, lo, hi = block
    if lo >= hi:  # Sees no key (a window past the end of a shorter k).
      outs.append(jnp.zeros((q.shape[0], stop - start, v.shape[-1]), v.dtype))
      lses.append(jnp.full((q.shape[0], stop - start), -jnp.inf, jnp.float32)
                  if sink is None else jnp.broadcast_to(sink[..., 0], (q.shape[0], stop - start)))
      continue
    s, _ = _logits(q, k, ids, block, mask, cap)
    row_max = _finite(jnp.max(s, axis=-1, keepdims=True))
    if sink is not None:
      row_max = jnp.maximum(row_max, sink)
    e = jnp.exp(s - row_max)  # One exp per logit; normalised after the matmul.
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
      total = total + jnp.exp(sink - row_max)
    out = jnp.einsum("gts,sh->gth", e.astype(v.dtype), v[lo:hi],
                     preferred_element_type=jnp.float32)
    outs.append(jnp.where(total > 0, out / total, 0.0).astype(v.dtype))
    lses.append((row_max + jnp.log(total))[..., 0])
  return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=1)


def _finite(lse):
  """-inf (a row that sees no key) as 0, so that its probabilities are 0, not NaN."""
  return jnp.where(jnp.isfinite(lse), lse, 0.0)


def _slice_backward(q, k, v, ids, sinks, out, lse, d_out, blocks, masks, cap):
  """One slice's (dq, dk, dv, d sinks [G] or None), float32, block by block over the same
  staircase."""
  delta = jnp.einsum("gth,gth->gt", d_out.astype(jnp.float32), out.astype(jnp.float32))
  lse = _finite(lse)
  d_sinks = None if sinks is None else -jnp.sum(  # The sink's p times (0 - delta).
      jnp.exp(sinks.astype(jnp.float32)[:, None] - lse) * delta, axis=-1)
  dq = []
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for block, mask in zip(blocks, masks):
    start, stop, lo, hi = block
    if lo >= hi:
      dq.append(jnp.zeros((q.shape[0], stop - start, q.shape[-1]), jnp.float32))
      continue
    s, slope = _logits(q, k, ids, block, mask, cap)
    p = jnp.exp(s - lse[:, start:stop, None])
    do = d_out[:, start:stop]
    dv = dv.at[lo:hi].add(jnp.einsum("gts,gth->sh", p.astype(do.dtype), do,
                                     preferred_element_type=jnp.float32))
    dp = jnp.einsum("gth,sh->gts", do, v[lo:hi], preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, start:stop, None])
    ds = (ds if slope is None else ds * slope).astype(q.dtype)
    dq.append(jnp.einsum("gts,sh->gth", ds, k[lo:hi], preferred_element_type=jnp.float32))
    dk = dk.at[lo:hi].add(jnp.einsum("gts,gth->sh", ds, q[:, start:stop],
                                     preferred_element_type=jnp.float32))
  return jnp.concatenate(dq, axis=1), dk, dv, d_sinks


def _masks(blocks, causal, window):
  return tuple(_position_mask(block, causal, window) for block in blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, ids, sinks, blocks, causal, window, cap):
  """q [R, G, T, H] (pre-scaled), k/v [R, S, H], ids [R, T] or None, sinks [R, G] or None
  -> [R, G, T, H]."""
  return _attention_fwd(q, k, v, ids, sinks, blocks, causal, window, cap)[0]


def _attention_fwd(q, k, v, ids, sinks, blocks, causal, window, cap):
  masks = _masks(blocks, causal, window)
  out, lse = jax.lax.map(lambda x: _slice_forward(*x, blocks, masks, cap),
                         (q, k, v, ids, sinks))
  return out, (q, k, v, ids, sinks, out, lse)


def _attention_bwd(blocks, causal, window, cap, residuals, d_out):
  masks = _masks(blocks, causal, window)
  dq, dk, dv, d_sinks = jax.lax.map(lambda x: _slice_backward(*x, blocks, masks, cap),
                                    (*residuals, d_out))
  q, k, v, _, sinks = residuals[:5]
  d_sinks = None if sinks is None else d_sinks.astype(sinks.dtype)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_sinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    local_window: int | None = None,
    logits_soft_cap: float | None = None,
    block_size: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
  """Attention over each query block's visible keys. q [B, T, N, H], k/v [B, S, K, H].

  Masks as `implementations` documents (causal top-left aligned; segment ids
  for self-attention; local window w: keys i - w .. i). Grouped K/V heads are
  used as they are, not repeated. Without causal or a window every block sees
  every key: correct, but nothing is skipped. A query that sees no key (only
  a window past the end of a shorter k) gets zeros.

  Args:
    scale: logits scale; default 1 / sqrt(H).
    logits_soft_cap: c: each scaled logit x becomes c * tanh(x / c); None: uncapped.
    block_size: query rows per block; default `default_block_size(T)`. Any
      T works: the last block is shorter.
    sinks: [N], a logit per query head in each softmax's denominator (GPT-OSS's sinks).
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  block_size = default_block_size(q_len) if block_size is None else block_size
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size {block_size!r} must be a positive int")
  scale = head_dim ** -0.5 if scale is None else float(scale)
  group = num_heads // num_kv_heads
  rows = batch * num_kv_heads
  # One row per (batch, K/V head), its G query heads together: [R, G, T, H].
  q = (q * jnp.asarray(scale, q.dtype)).reshape(batch, q_len, num_kv_heads, group, head_dim)
  q = q.transpose(0, 2, 3, 1, 4).reshape(rows, group, q_len, head_dim)
  k, v = (x.transpose(0, 2, 1, 3).reshape(rows, kv_len, head_dim) for x in (k, v))
  ids = None if segment_ids is None else jnp.repeat(segment_ids, num_kv_heads, axis=0)
  blocks = _blocks(q_len, kv_len, block_size, causal, local_window)
  cap = None if logits_soft_cap is None else float(logits_soft_cap)
  rows_sinks = None if sinks is None else jnp.tile(sinks.reshape(num_kv_heads, group),
                                                   (batch, 1))  # [R, G]: row b * K + k.
  out = _attention(q, k, v, ids, rows_sinks, blocks, causal, local_window, cap)
  out = out.reshape(batch, num_kv_heads, group, q_len, head_dim).transpose(0, 3, 1, 2, 4)
  return out.reshape(batch, q_len, num_heads, head_dim)
