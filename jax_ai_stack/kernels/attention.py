"""The single attention entry point used by every model of the recipes.

`attention` asks the registry which kernel fits the backend, shapes, dtype and
masks (cached per request, so calling it inside `jit`, `grad` or `remat` costs
one lookup per trace and prints nothing), then calls it; if the kernel still
raises `NotImplementedError`, the next eligible one runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import registry


def _check_inputs(q, k, v, segment_ids, kv_seq_lengths) -> None:
  """Shape and dtype errors the kernels would report cryptically, named here."""
  if k.shape != v.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape [B, S, K, H]")
  if not q.dtype == k.dtype == v.dtype:
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  if segment_ids is not None:
    if segment_ids.shape != q.shape[:2]:
      raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {q.shape[:2]}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
  if kv_seq_lengths is not None:
    if kv_seq_lengths.shape != q.shape[:1]:
      raise ValueError(f"kv_seq_lengths {kv_seq_lengths.shape} must be [B] = {q.shape[:1]}")
    if not jnp.issubdtype(kv_seq_lengths.dtype, jnp.integer):
      raise ValueError(f"kv_seq_lengths must be integers, got {kv_seq_lengths.dtype}")


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
    implementation: str | Sequence[str] = "auto",
) -> jax.Array:
  """Dot-product attention. q: [B, T, N, H]; k, v: [B, S, K, H] with K dividing N.

  Differentiable, on every implementation. Masks combine (all must allow):

  Args:
    q, k, v: queries, keys, values of one dtype.
    causal: query i sees keys j <= i (top-left aligned, as `jax.nn`). For
      KV-cache decoding pass causal=False and `kv_seq_lengths`.
    segment_ids: [B, T] ints (self-attention only, T == S); tokens attend only
      within their own segment. 0 is an id like any other.
    scale: logits scale, a Python number; default 1 / sqrt(H).
    local_window: w >= 0: query i sees keys i - w .. i.
    kv_seq_lengths: [B] ints; keys at or past that index are ignored.
    implementation: "auto", a registry name, or a sequence / comma-separated
      list tried in order. With "auto", the environment variable
      `JAX_AI_STACK_ATTENTION` or a loaded autotune file may decide instead.

  Returns:
    [B, T, N, H], the dtype of q.

  Raises:
    ValueError: inconsistent shapes or dtypes, or an unknown implementation.
    registry.NoImplementationError: no implementation fits; names each reason.
  """
  _check_inputs(q, k, v, segment_ids, kv_seq_lengths)
  choice = registry.select(
      q.shape, k.shape, q.dtype,
      causal=causal, segment_ids=segment_ids is not None, local_window=local_window,
      kv_seq_lengths=kv_seq_lengths is not None, implementation=implementation,
  )
  scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
  refusals = []
  for name, interpret in choice.fallbacks:
    try:
      return registry.IMPLEMENTATIONS[name].run(
          q, k, v, causal=causal, segment_ids=segment_ids, scale=scale,
          local_window=local_window, kv_seq_lengths=kv_seq_lengths, interpret=interpret,
      )
    except NotImplementedError as e:
      refusals.append(f"{name}: {e}")
  raise registry.NoImplementationError(
      f"every eligible attention implementation refused {choice.request.describe()}: "
      + "; ".join(refusals)
  )
