"""The single attention entry point used by every model of the recipes.

PLACEHOLDER until the kernels issue: a thin call to `jax.nn.dot_product_attention`.
"""

from __future__ import annotations

import jax


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    segment_ids: jax.Array | None = None,
    scale: float | None = None,
    local_window: int | None = None,
    kv_seq_lengths: jax.Array | None = None,
    implementation: str = "auto",
) -> jax.Array:
  """Dot-product attention. q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N.

  segment_ids: [B, T] ints (self-attention only); tokens attend only within
  their own segment. kv_seq_lengths: [B] ints; keys at or past that index are
  ignored (KV-cache decoding).
  """
  del implementation
  mask = None
  if segment_ids is not None:
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]
  window = (local_window, 0) if local_window is not None else None
  return jax.nn.dot_product_attention(
      q, k, v, mask=mask, scale=scale, is_causal=causal, local_window_size=window,
      key_value_seq_lengths=kv_seq_lengths,
  )
