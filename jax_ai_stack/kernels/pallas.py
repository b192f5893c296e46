"""Adapters for JAX's own Pallas kernels (Triton on GPU, Mosaic on TPU).

Same signature and mask semantics as the adapters in `implementations`. These
kernels lack GQA (K/V heads are repeated) and some masks (folded into segment
ids where possible); each raises `NotImplementedError` for what it cannot do.
With `interpret=True` they run in Pallas interpret mode, which is how the
tests check them on CPU.

Example: the Triton kernel, interpreted on CPU, against `jax.nn`'s attention.
  >>> import jax.numpy as jnp
  >>> from jax_ai_stack.kernels import implementations
  >>> from jax_ai_stack.kernels.request import Request
  >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
  >>> request = Request.from_shapes(q.shape, k.shape, q.dtype, causal=True)
  >>> out = implementations.call(pallas_gpu, request, q, k, v, interpret=True)
  >>> expected = implementations.call(implementations.jax_nn, request, q, k, v)
  >>> out.shape, bool(jnp.allclose(out, expected, atol=1e-5))
  ((1, 8, 2, 4), True)
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp


def _repeat_kv(k: jax.Array, v: jax.Array, num_heads: int) -> tuple[jax.Array, jax.Array]:
  """GQA for kernels without it: K/V head g serves query heads g*G .. g*G+G-1."""
  groups = num_heads // k.shape[2]
  if groups == 1:
    return k, v
  return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def _segment_ids_with_lengths(
    segment_ids: jax.Array | None,
    kv_seq_lengths: jax.Array | None,
    batch: int,
    q_len: int,
    kv_len: int,
) -> tuple[jax.Array, jax.Array] | None:
  """Folds kv_seq_lengths into (q, kv) segment ids for kernels without lengths.

  Ids are shifted by one so that 0 can mark keys past the length: no query
  carries id 0, so those keys are never attended.
  """
  if kv_seq_lengths is None:
    if segment_ids is None:
      return None
    ids = segment_ids.astype(jnp.int32)
    return ids, ids
  if segment_ids is None:
    q_ids = jnp.ones((batch, q_len), jnp.int32)
    kv_ids = jnp.ones((batch, kv_len), jnp.int32)
  else:
    q_ids = kv_ids = segment_ids.astype(jnp.int32) + 1
  valid = jnp.arange(kv_len)[None, :] < kv_seq_lengths.astype(jnp.int32)[:, None]
  return q_ids, jnp.where(valid, kv_ids, 0)


def _largest_block(length: int, cap: int) -> int:
  """The largest power of two <= cap that divides length."""
  block = cap
  while block > 1 and length % block:
    block //= 2
  return block


def _in_tpu_interpret_mode(fn):
  """`fn` with forward AND backward traced under Pallas TPU interpret mode.

  `pltpu.force_tpu_interpret_mode()` only affects `pallas_call`s traced inside
  it; a kernel's custom VJP is traced later, by `jax.grad`, outside any context
  set in the forward. Wrapping both halves makes the kernel differentiable on
  CPU without asking the caller to hold the context around `jax.grad`.
  """
  from jax.experimental.pallas import tpu as pltpu

  @jax.custom_vjp
  def call(*args):
    with pltpu.force_tpu_interpret_mode():
      return fn(*args)

  def fwd(*args):
    with pltpu.force_tpu_interpret_mode():
      return jax.vjp(fn, *args)

  def bwd(vjp_fn, cotangent):
    with pltpu.force_tpu_interpret_mode():
      return vjp_fn(cotangent)

  call.defvjp(fwd, bwd)
  return call


@functools.cache
def _pallas_gpu_module():
  # jax 0.12 deprecates this module in favour of tokamax; we keep it as a
  # fallback that supports segment ids on every GPU Triton runs on.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu_attention
  return pallas_gpu_attention


def pallas_gpu(q, k, v, *, causal, segment_ids, scale, local_window,
               kv_seq_lengths, interpret, logits_soft_cap=None):
  if logits_soft_cap is not None:
    raise NotImplementedError("pallas_gpu does not support logits_soft_cap")
  """JAX's Pallas (Triton) flash attention, `pallas.ops.gpu.attention.mha`."""
  if local_window is not None or kv_seq_lengths is not None:
    raise NotImplementedError("pallas_gpu supports neither local_window nor kv_seq_lengths")
  module = _pallas_gpu_module()
  k, v = _repeat_kv(k, v, q.shape[2])
  q_len, kv_len = q.shape[1], k.shape[1]
  blocks = module.BlockSizes(
      block_q=_largest_block(q_len, 128),
      block_k=_largest_block(kv_len, 128),
      block_q_dkv=_largest_block(q_len, 32),
      block_kv_dkv=_largest_block(kv_len, 32),
      block_q_dq=_largest_block(q_len, 32),
      block_kv_dq=_largest_block(kv_len, 32),
  )
  ids = None if segment_ids is None else segment_ids.astype(jnp.int32)
  return module.mha(
      q, k, v, ids, sm_scale=scale, causal=causal, block_sizes=blocks, interpret=interpret
  )


def pallas_tpu_flash(q, k, v, *, causal, segment_ids, scale, local_window,
                     kv_seq_lengths, interpret, logits_soft_cap=None):
  if logits_soft_cap is not None:
    raise NotImplementedError("pallas_tpu_flash does not support logits_soft_cap")
  """JAX's Pallas TPU flash attention, `pallas.ops.tpu.flash_attention`."""
  if local_window is not None:
    raise NotImplementedError("pallas_tpu_flash does not support local_window")
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

  batch, q_len, num_heads, _ = q.shape
  kv_len = k.shape[1]
  k, v = _repeat_kv(k, v, num_heads)
  ids = _segment_ids_with_lengths(segment_ids, kv_seq_lengths, batch, q_len, kv_len)
  heads_major = lambda x: x.transpose(0, 2, 1, 3)  # [B, T, N, H] <-> [B, N, T, H]

  def run(q, k, v, *ids):
    segments = tpu_flash.SegmentIds(q=ids[0], kv=ids[1]) if ids else None
    return tpu_flash.flash_attention(
        q, k, v, segment_ids=segments, causal=causal, sm_scale=scale
    )

  if interpret:
    run = _in_tpu_interpret_mode(run)
  out = run(heads_major(q), heads_major(k), heads_major(v), *(ids or ()))
  return heads_major(out)


@functools.lru_cache(maxsize=64)
def _splash_kernel(q_len, kv_len, num_heads, causal, local_window, interpret,
                   logits_soft_cap=None):
  """Builds (and caches) a splash kernel: its mask is preprocessed in NumPy.

  Built under `ensure_compile_time_eval` so that its mask arrays are concrete
  constants, not tracers of whichever trace first asked for the kernel.
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  shape = (q_len, kv_len)
  if local_window is not None:
    head_mask = splash.LocalMask(shape, window_size=(local_window, 0), offset=0)
  elif causal:
    head_mask = splash.CausalMask(shape)
  else:
    head_mask = splash.FullMask(shape)
  mask = splash.MultiHeadMask([head_mask] * num_heads)
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret,
                                  attn_logits_soft_cap=logits_soft_cap)


def pallas_tpu_splash(q, k, v, *, causal, segment_ids, scale, local_window,
                      kv_seq_lengths, interpret, logits_soft_cap=None, sinks=None):
  """JAX's Pallas TPU splash attention (GQA, local windows, soft caps and attention sinks
  natively: a sink is a logit on the scaled scale, as the queries are scaled here)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  batch, q_len, num_heads, _ = q.shape
  kv_len = k.shape[1]
  kernel = _splash_kernel(q_len, kv_len, num_heads, causal, local_window, interpret,
                          logits_soft_cap)
  ids = _segment_ids_with_lengths(segment_ids, kv_seq_lengths, batch, q_len, kv_len)
  heads_major = lambda x: x.transpose(0, 2, 1, 3)
  q = heads_major((q * scale).astype(q.dtype))  # splash does not scale logits.

  def one_example(q, k, v, ids):
    segments = None if ids is None else splash.SegmentIds(q=ids[0], kv=ids[1])
    return kernel(q, k, v, segment_ids=segments, sinks=sinks)

  out = jax.vmap(one_example)(q, heads_major(k), heads_major(v), ids)
  return heads_major(out)
