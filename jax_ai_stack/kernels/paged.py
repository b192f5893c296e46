"""Attention over a paged KV cache: plain XLA, one page of keys at a time.

The generation engine keeps keys and values in a pool of fixed-size pages, and each
row (a request) has a block table: the pool's pages that hold its positions, in
order. A row's queries (one when decoding, a chunk of its prompt when prefilling) sit
at given positions and attend causally to the row's positions up to their own.

The pages are read one table column at a time in a loop, with an online softmax
(a running maximum, sum and weighted values, rescaled as each page arrives), so a
call's work follows the table's width, which the engine cuts to what its rows need.
A page past a query's position (or before its sliding window) is masked whole and
adds exactly nothing: its weights are exp(-inf) = 0 and the running maximum does not
move (a rescale by exp(0) = 1). So a row's result does not depend on the width: a
request gives the same bits beside short rows or long ones.

Example: one query at position 2 (it sees 3 keys) over pages of 2 positions (pages 1, 2).
  >>> import jax.numpy as jnp
  >>> pool = jnp.ones((3, 2, 1, 4))  # [pages, page_size, kv_heads, head_dim]
  >>> out = paged_attention(jnp.ones((1, 1, 2, 4)), pool, pool, jnp.asarray([[1, 2]]),
  ...                       jnp.asarray([[2]]), scale=0.5)
  >>> out.shape, float(out[0, 0, 0, 0])
  ((1, 1, 2, 4), 1.0)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_table: jax.Array, positions: jax.Array, *, scale: float,
                    logits_soft_cap: float | None = None,
                    local_window: int | None = None) -> jax.Array:
  """Each row's queries over its pages.

  q [B, T, N, H]; k_pages, v_pages [pages, page_size, K, H] (N a multiple of K: grouped
  queries); block_table [B, W] int32, row b's positions j * page_size ... in page
  block_table[b, j]; positions [B, T]: query t of row b sits at positions[b, t] and
  attends to the row's positions up to it, with `local_window` w to the last w + 1 of
  them. Returns [B, T, N, H] in q's dtype.
  """
  b, t, n, h = q.shape
  page_size, k = k_pages.shape[1], k_pages.shape[2]
  queries = q.reshape(b, t, k, n // k, h).astype(jnp.float32) * scale
  last = positions[:, :, None]  # [B, T, 1]: each query's own position.
  first = jnp.zeros_like(last) if local_window is None else last - local_window
  offsets = jnp.arange(page_size)

  def page(carry, column):
    top, total, weighted = carry  # [B, T, K, G], [B, T, K, G], [B, T, K, G, H]
    pages = block_table[:, column]
    keys = k_pages[pages].astype(jnp.float32)  # [B, P, K, H]
    values = v_pages[pages].astype(jnp.float32)
    logits = jnp.einsum("btkgh,bpkh->btkgp", queries, keys)
    if logits_soft_cap is not None:
      logits = jnp.tanh(logits / logits_soft_cap) * logits_soft_cap
    keys_at = column * page_size + offsets
    seen = ((keys_at <= last) & (keys_at >= first))[:, :, None, None, :]  # [B, T, 1, 1, P]
    logits = jnp.where(seen, logits, -jnp.inf)
    new_top = jnp.maximum(top, logits.max(-1))
    # A query that has seen nothing yet keeps -inf: rescale by 1, not exp(-inf + inf).
    rescale = jnp.where(new_top == -jnp.inf, 1.0, jnp.exp(top - new_top))
    weights = jnp.where(seen, jnp.exp(logits - new_top[..., None]), 0.0)
    total = total * rescale + weights.sum(-1)
    weighted = (weighted * rescale[..., None]
                + jnp.einsum("btkgp,bpkh->btkgh", weights, values))
    return (new_top, total, weighted), None

  groups = (b, t, k, n // k)
  start = (jnp.full(groups, -jnp.inf), jnp.zeros(groups), jnp.zeros((*groups, h)))
  (_, total, weighted), _ = jax.lax.scan(page, start, jnp.arange(block_table.shape[1]))
  return (weighted / total[..., None]).reshape(b, t, n, h).astype(q.dtype)
