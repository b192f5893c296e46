"""Paged attention: equal to a dense causal softmax over each row's positions (decoding
and chunks of queries, grouped queries, a soft cap, a sliding window), and bitwise the
same however wide the table."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_ai_stack.kernels.paged import paged_attention

RNG = np.random.default_rng(0)
PAGE, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def _pool_and_tables(rows, width):
  """Random pages, each row's positions on pages drawn at random from the pool (page 0
  unused), and the same keys laid out densely [B, width * PAGE, K, H]."""
  pages = 1 + RNG.permutation(len(rows) * width)
  tables = pages.reshape(len(rows), width).astype(np.int32)
  pool = RNG.normal(size=(2, 1 + pages.size, PAGE, KV_HEADS, DIM)).astype(np.float32)
  dense = pool[:, tables].reshape(2, len(rows), width * PAGE, KV_HEADS, DIM)
  return pool, tables, dense


def _dense(q, keys, values, positions, scale, cap=None, window=None):
  """softmax over each query's positions [first, position], in float64."""
  group = HEADS // KV_HEADS
  out = np.zeros(q.shape)
  for (b, t), position in np.ndenumerate(positions):
    first = 0 if window is None else max(0, position - window)
    for n in range(HEADS):
      k = keys[b, first:position + 1, n // group]
      v = values[b, first:position + 1, n // group]
      logits = (k.astype(np.float64) @ q[b, t, n]) * scale
      if cap is not None:
        logits = np.tanh(logits / cap) * cap
      weights = np.exp(logits - logits.max())
      out[b, t, n] = weights @ v / weights.sum()
  return out


@pytest.mark.parametrize("cap, window", [(None, None), (5.0, None), (None, 5), (3.0, 2)])
@pytest.mark.parametrize("positions", [[[0], [6], [11], [15]],  # Decoding: a query a row.
                                       [[5, 6, 7], [0, 1, 2], [13, 14, 15], [8, 9, 10]]])
def test_equals_a_dense_causal_softmax_over_each_row_s_positions(cap, window, positions):
  positions = np.asarray(positions, np.int32)
  pool, tables, (keys, values) = _pool_and_tables(positions, width=4)
  q = RNG.normal(size=(*positions.shape, HEADS, DIM)).astype(np.float32)
  out = paged_attention(jnp.asarray(q), jnp.asarray(pool[0]), jnp.asarray(pool[1]),
                        jnp.asarray(tables), jnp.asarray(positions), scale=0.3,
                        logits_soft_cap=cap, local_window=window)
  np.testing.assert_allclose(np.asarray(out),
                             _dense(q, keys, values, positions, 0.3, cap, window),
                             rtol=1e-5, atol=1e-5)


def test_pages_past_a_row_s_length_change_no_bit_of_it():
  """The same rows with a table twice as wide, its extra pages full of large values: the
  engine reads as many pages as its longest row needs, so this is batch invariance."""
  positions = jnp.asarray([[1, 2], [6, 7]])
  pool, tables, _ = _pool_and_tables(positions, width=2)
  wide_pool = np.concatenate([pool, 100 * RNG.normal(size=(2, 4, *pool.shape[2:]))], axis=1)
  wide_pool = wide_pool.astype(np.float32)
  extra = np.arange(pool.shape[1], pool.shape[1] + 4, dtype=np.int32).reshape(2, 2)
  q = jnp.asarray(RNG.normal(size=(2, 2, HEADS, DIM)).astype(np.float32))
  for window in (None, 3):
    narrow = paged_attention(q, jnp.asarray(pool[0]), jnp.asarray(pool[1]), jnp.asarray(tables),
                             positions, scale=0.3, local_window=window)
    wide = paged_attention(q, jnp.asarray(wide_pool[0]), jnp.asarray(wide_pool[1]),
                           jnp.asarray(np.concatenate([tables, extra], axis=1)),
                           positions, scale=0.3, local_window=window)
    assert np.array_equal(np.asarray(narrow), np.asarray(wide))
