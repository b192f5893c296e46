"""Adapters: one function per attention kernel, all with the same signature.

This module holds those of `jax.nn` (XLA, cuDNN), tokamax and this package's
`blocked` attention; `pallas` holds JAX's Pallas kernels.

Each adapter takes `q: [B, T, N, H]`, `k, v: [B, S, K, H]` and keyword-only
`causal, segment_ids, scale, local_window, kv_seq_lengths, interpret,
logits_soft_cap`, and calls
one library's kernel with the masks translated into that library's terms. The
adapters check nothing the capability table (`table`) already checks; they raise
`NotImplementedError` for what the library itself would reject, so that the
caller falls back to the next implementation.

Mask semantics shared by every adapter (and by the tests' reference):
  * causal: query i sees keys j <= i (top-left aligned, as `jax.nn`).
  * local_window w: query i sees keys j with i - w <= j <= i.
  * segment_ids [B, T] (self-attention): query i sees key j iff their ids match.
  * kv_seq_lengths [B]: keys at index >= length are ignored.
  * logits_soft_cap c: each scaled logit x becomes c * tanh(x / c) before the
    masks (Gemma 2's), so a large logit cannot swamp the softmax.
  * chunk_size C (only to the adapters whose table entry takes chunks, as `chunk_size=`):
    query i, at position p_i, sees keys j with j // C == p_i // C (and the masks above);
    p_i is i, or with kv_seq_lengths L the row's last T positions' (L - T + i: decoding).
  * sinks [N] (only to the adapters whose table entry takes them, as `sinks=`): query head
    n's softmax gets one more logit, sinks[n], in its denominator, with no value (GPT-OSS's
    learned attention sinks): the weights sum to less than one.

Libraries are imported inside the adapters: tokamax alone takes seconds to
import, and only the kernel that runs should pay for its import.

Callers go through `call`, which takes the masks a `Request` describes, so the
model, the probe, autotuning and the benchmark run a kernel the same way.

Example: two adapters, one request, the same result.
  >>> import jax, jax.numpy as jnp
  >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
  >>> request = Request.from_shapes(q.shape, k.shape, q.dtype, causal=True)
  >>> dense = call(jax_nn, request, q, k, v)
  >>> blocked = call(xla_blocked, request, q, k, v)
  >>> dense.shape, bool(jnp.allclose(dense, blocked, atol=1e-5))
  ((1, 8, 2, 4), True)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_ai_stack.absl_flags import tokamax_flags_parsed
from jax_ai_stack.kernels.request import Request


def call(
    kernel: Callable[..., jax.Array],
    request: Request,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    kv_seq_lengths: jax.Array | None = None,
    *,
    interpret: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
  """Runs one adapter (an `Implementation.run`) on arrays that fit `request`.

  The request supplies the static masks (causal, local_window), the scale
  (default 1 / sqrt(head_dim)) and the soft cap; the arrays supply the dynamic
  masks; `sinks` [N] (the request's `sinks`) go only to adapters that take them.
  """
  scale = request.head_dim ** -0.5 if request.scale is None else request.scale
  extra = {} if sinks is None else {"sinks": sinks}
  if request.chunk_size is not None:
    extra["chunk_size"] = request.chunk_size
  return kernel(
      q, k, v, causal=request.causal, segment_ids=segment_ids, scale=scale,
      local_window=request.local_window, kv_seq_lengths=kv_seq_lengths, interpret=interpret,
      logits_soft_cap=request.logits_soft_cap, **extra,
  )


def _segment_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] ids -> [B, 1, T, T] boolean mask of equal ids."""
  return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _window(local_window: int | None) -> tuple[int, int] | None:
  return None if local_window is None else (local_window, 0)


def _lengths(kv_seq_lengths: jax.Array | None) -> jax.Array | None:
  return None if kv_seq_lengths is None else kv_seq_lengths.astype(jnp.int32)


@functools.cache
def import_tokamax():
  """Imports tokamax, keeping tokamax 0.0.12 off the host's command line (see `absl_flags`)."""
  tokamax_flags_parsed()
  import tokamax

  return tokamax


def compiling_for(platform: str) -> contextlib.AbstractContextManager:
  """A context in which programs trace for `platform`'s devices from this host: enter it
  around `jit(...).lower(...)` (a kernel's backward pass traces after its forward call).

  Where `platform` is not the host's backend (compiling ahead of time for a TPU slice
  from a CPU, say), tokamax's device check would refuse every TPU or GPU kernel:
  its `cross_compile` option turns that check off. Elsewhere nothing changes.
  """
  if platform == jax.default_backend():
    return contextlib.nullcontext()
  return import_tokamax().config.cross_compile(True)


def jax_nn(q, k, v, *, causal, segment_ids, scale, local_window, kv_seq_lengths,
           interpret, logits_soft_cap=None, implementation="xla", sinks=None, chunk_size=None):
  """`jax.nn.dot_product_attention` with `implementation` "xla" or "cudnn"; with `sinks` or
  `chunk_size` (xla only), `softmax_with_sinks`, which jax.nn has no input for."""
  del interpret
  if sinks is not None or chunk_size is not None:
    if implementation != "xla":
      raise NotImplementedError(f"jax.nn's {implementation} attention has no sinks or chunks")
    return softmax_with_sinks(q, k, v, sinks, causal=causal, segment_ids=segment_ids,
                              scale=scale, local_window=local_window,
                              kv_seq_lengths=kv_seq_lengths, logits_soft_cap=logits_soft_cap,
                              chunk_size=chunk_size)
  if logits_soft_cap is not None:  # The table says so too; this guards direct calls.
    raise NotImplementedError("jax.nn.dot_product_attention has no logits_soft_cap")
  return jax.nn.dot_product_attention(
      q, k, v,
      mask=None if segment_ids is None else _segment_mask(segment_ids),
      scale=scale,
      is_causal=causal,
      key_value_seq_lengths=_lengths(kv_seq_lengths),
      local_window_size=_window(local_window),
      implementation=implementation,
  )


def softmax_with_sinks(q, k, v, sinks, *, causal, segment_ids, scale, local_window,
                       kv_seq_lengths, logits_soft_cap=None, chunk_size=None):
  """Plain attention (the masks above, `chunk_size`'s too) whose softmax of query head n has
  sinks[n] in its denominator (None: no sinks): weights exp(x_j - m) / (sum_j exp(x_j - m) +
  exp(sinks[n] - m)), m the largest of the logits and the sink, in float32. Returns
  [B, T, N, H] in q's dtype."""
  b, t, n, h = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  groups = n // kv_heads
  queries = q.reshape(b, t, kv_heads, groups, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", queries, k,
                      preferred_element_type=jnp.float32) * scale
  if logits_soft_cap is not None:
    logits = jnp.tanh(logits / logits_soft_cap) * logits_soft_cap
  query_at, key_at = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  mask = jnp.ones((t, s), bool)
  if causal:
    mask &= key_at <= query_at
  if local_window is not None:
    mask &= key_at >= query_at - local_window
  mask = mask[None, None, None]  # [1, 1, 1, T, S]
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, None, :, None] == segment_ids[:, None, None, None, :])
  if kv_seq_lengths is not None:
    mask = mask & (key_at < kv_seq_lengths[:, None, None, None, None])
  if chunk_size is not None:  # Each query's position: i, or the row's last T (decoding).
    at = query_at if kv_seq_lengths is None else (
        kv_seq_lengths[:, None, None, None, None] - t + query_at)
    mask = mask & (key_at // chunk_size == at // chunk_size)
  logits = jnp.where(mask, logits, -jnp.inf)
  if sinks is None:  # A sink of -inf adds nothing; a fully masked row gives zeros.
    sinks = jnp.full((n,), -jnp.inf, jnp.float32)
  sink = sinks.astype(jnp.float32).reshape(1, kv_heads, groups, 1, 1)
  top = jnp.maximum(logits.max(-1, keepdims=True), sink)
  weights = jnp.where(mask, jnp.exp(logits - top), 0.0)
  probs = weights / (weights.sum(-1, keepdims=True) + jnp.exp(sink - top))
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(jnp.float32))
  return out.reshape(b, t, n, h).astype(q.dtype)


def tokamax_installed_attention() -> tuple[str, ...]:
  """The names `tokamax.dot_product_attention(implementation=...)` accepts here.

  The one private tokamax import of this package, checked against tokamax
  0.0.12 and 0.0.17: both look each name up in
  `tokamax._src.ops.attention.api.IMPLEMENTATIONS`, whose contents depend on
  the install (its Triton and Mosaic modules may fail to import), and raise
  ValueError for a missing one, not the NotImplementedError that lets
  `attention` fall back. The public `tokamax.DotProductAttentionImplementation`
  Literal cannot replace it: it lists "mosaic" (resolved by device kind), not
  "mosaic_gpu" / "mosaic_tpu", and not what is installed.
  """
  import_tokamax()
  from tokamax._src.ops.attention import api as tokamax_api

  return tuple(sorted(tokamax_api.IMPLEMENTATIONS))


def tokamax_attention(q, k, v, *, causal, segment_ids, scale, local_window,
                      kv_seq_lengths, interpret, implementation, logits_soft_cap=None):
  """`tokamax.dot_product_attention` (public) with one named tokamax implementation."""
  del interpret
  tokamax = import_tokamax()
  # Checked here, not at import: which kernels exist depends on the install.
  if implementation not in (installed := tokamax_installed_attention()):
    raise NotImplementedError(
        f"tokamax {tokamax.__version__} has no {implementation!r} attention"
        f" (it has {', '.join(installed)})"
    )
  return tokamax.dot_product_attention(
      q, k, v,
      mask=None if segment_ids is None else _segment_mask(segment_ids),
      scale=scale,
      is_causal=causal,
      key_value_seq_lengths=_lengths(kv_seq_lengths),
      local_window_size=_window(local_window),
      logits_soft_cap=logits_soft_cap,
      implementation=implementation,
  )


def xla_blocked(q, k, v, *, causal, segment_ids, scale, local_window, kv_seq_lengths,
                interpret, logits_soft_cap=None, sinks=None):
  """`blocked.blocked_attention`: skips the keys a causal or windowed mask hides."""
  del interpret
  if kv_seq_lengths is not None:  # The table says so too; this guards direct calls.
    raise NotImplementedError("xla_blocked takes no kv_seq_lengths")
  from jax_ai_stack.kernels import blocked

  return blocked.blocked_attention(
      q, k, v, causal=causal, segment_ids=segment_ids, scale=scale, local_window=local_window,
      logits_soft_cap=logits_soft_cap, sinks=sinks)
