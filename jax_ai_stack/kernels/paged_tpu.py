"""JAX's ragged paged-attention kernel for TPUs (`paged_attention`'s "pallas_tpu"): the pool
layout it reads, the shapes it takes, its block sizes per chip, and the call.

The kernel reads one pool, [pages, page_size, 2 * kv_heads, head_dim], each head's key and
value side by side: a model that decodes with it lays its pool out so and writes new rows
with `fused_pool`; pools of the other kernels' layout ([kv_heads, pages, page_size,
head_dim], keys and values apart) are gathered into it page by page in every call
(`fuse_pages`: docs/kernels.md says what that copy costs). Its block sizes are its own tuned
table's for the chip compiled for, a chip this machine may lack (`tpu_block_sizes`).

Example: a key and a value of one head, side by side as the kernel reads them.
  >>> import jax.numpy as jnp
  >>> fused_pool(jnp.zeros((1, 1, 1, 2)), jnp.ones((1, 1, 1, 2))).tolist()
  [[[[0.0, 0.0], [1.0, 1.0]]]]
  >>> tpu_kernel_takes(128, 8, jnp.bfloat16), tpu_kernel_takes(64, 8, jnp.bfloat16)
  (True, False)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import rules
from jax_ai_stack.kernels.request import Backend, target_backend

__all__ = ["KV_BLOCK_VMEM", "fuse_pages", "fused_pool", "pallas_tpu", "target_device_kind",
           "tpu_block_sizes", "tpu_kernel_fits", "tpu_kernel_takes"]

KV_BLOCK_VMEM = 8 << 20
"""The most scoped VMEM (half a v5e's 16 MiB) the TPU kernel's double-buffered block of pages
may take: its untuned 128 pages of 8B widths took 17.5 MiB with the queries', refused."""


def tpu_kernel_fits(q: jax.Array, k_pages: jax.Array) -> bool:
  """Whether JAX's TPU kernel takes q [..., H] over pools [K, ...] (`tpu_kernel_takes`)."""
  return tpu_kernel_takes(q.shape[-1], k_pages.shape[0], k_pages.dtype)


def tpu_kernel_takes(head_dim: int, kv_heads: int, dtype) -> bool:
  """Whether JAX's TPU kernel takes these heads: head_dim a multiple of 128 (its lanes) and
  2 * kv_heads that its dtype's tiling divides (1, 2, 4, 8 or a multiple of 8 words)."""
  packing = 4 // jnp.dtype(dtype).itemsize
  words, rest = divmod(2 * kv_heads, packing)
  return head_dim % 128 == 0 and not rest and (words in (1, 2, 4, 8) or words % 8 == 0)


def fuse_pages(k_pages: jax.Array, v_pages: jax.Array, block_table: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """The pages `block_table` [B, W] names of pools [K, pages, page_size, H], gathered into the
  TPU kernel's layout [B * W, page_size, 2 * K, H] (each head's keys and values side by
  side), and the table renumbered to them: the copy a pool not laid out for the kernel
  costs in every call (docs/kernels.md; a model's pool for it is `fused_pool`'s)."""
  b, width = block_table.shape
  k, page_size, h = k_pages.shape[0], k_pages.shape[2], k_pages.shape[3]
  pages = block_table.reshape(-1)
  both = jnp.stack([k_pages[:, pages], v_pages[:, pages]], axis=1)  # [K, 2, B * W, P, H]
  kv_pages = jnp.transpose(both, (2, 3, 0, 1, 4)).reshape(b * width, page_size, 2 * k, h)
  return kv_pages, jnp.arange(b * width, dtype=jnp.int32).reshape(b, width)


def fused_pool(k: jax.Array, v: jax.Array) -> jax.Array:
  """New keys and values [B, T, K, H] as rows of the TPU kernel's pool layout: [B, T, 2K, H],
  each head's key and value side by side."""
  return jnp.stack([k, v], axis=3).reshape(*k.shape[:2], 2 * k.shape[2], k.shape[3])


def target_device_kind() -> str:
  """The device kind a kernel traced now is compiled for: the abstract mesh's (a chip this
  machine lacks, as Pallas' TPU kernels read it), else this machine's first device's."""
  return target_backend().device_kind


def tpu_block_sizes(q_shape, kv_pages_shape, width: int, dtype, device_kind: str
                    ) -> tuple[int, int]:
  """(pages, queries) per block of JAX's ragged paged-attention kernel: its tuned table's for
  `device_kind` (the kernel looks up this machine's device, which has none off a TPU), the
  pages' double buffer within `KV_BLOCK_VMEM` (a power of two of pages)."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel, tuned_block_sizes

  tokens, heads, head_dim = q_shape
  page_size, combined = kv_pages_shape[1], kv_pages_shape[2]
  heads_per_block, combined_per_block = kernel.get_min_heads_per_blk(heads, combined, dtype, dtype)
  key = tuned_block_sizes.simplify_key((dtype, dtype, heads_per_block, combined_per_block // 2,
                                        head_dim, page_size, tokens, width))
  generation = rules.tpu_generation(Backend("tpu", device_kind)) or 0
  name = f"TPU v{generation}"
  pages, queries = (32, 32) if generation == 4 else (128, 32)
  pages, queries = tuned_block_sizes.TUNED_BLOCK_SIZES.get(name, {}).get(key, (pages, queries))
  page_bytes = 2 * page_size * combined_per_block * head_dim * jnp.dtype(dtype).itemsize
  fitting = max(KV_BLOCK_VMEM // page_bytes, 1)
  return min(width, pages, 1 << (fitting.bit_length() - 1)), min(tokens, queries)


def pallas_tpu(q, kv_pages, block_table, positions, *, scale, logits_soft_cap=None,
               local_window=None, kernel=None):
  """`paged.paged_attention` through JAX's ragged paged-attention kernel for TPUs, over a pool in
  its own layout: kv_pages [pages, page_size, 2 * K, H], each head's keys and values side
  by side (`fuse_pages`, `fused_pool`); `kernel`: another function of its signature, as the
  tests give its reference on CPU.

  Each row's queries are its last positions[b, -1] + 1 - T ones (a chunk of a prompt, or
  one token): the kernel's ragged layout.
  """
  b, t, n, h = q.shape
  width = block_table.shape[1]
  tuning = {}
  if kernel is None:
    kind = target_device_kind()
    if rules.tpu_generation(Backend("tpu", kind)) is None:
      raise ValueError(f"paged attention 'pallas_tpu' runs on TPUs only, not {kind}: JAX "
                       f"{jax.__version__}'s TPU interpret mode cannot run its ragged "
                       "paged-attention kernel; choose xla (or, compiling for a TPU from "
                       "this machine, trace inside `jax.sharding.use_abstract_mesh` of the "
                       "TPU devices' mesh, whose chip Pallas compiles for)")
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as ragged

    kernel = ragged.ragged_paged_attention
    tuning = dict(zip(("num_kv_pages_per_block", "num_queries_per_block"), tpu_block_sizes(
        (b * t, n, h), (b * width, *kv_pages.shape[1:]), width, kv_pages.dtype, kind)))
  out = kernel(q.reshape(b * t, n, h), kv_pages, (positions[:, -1] + 1).astype(jnp.int32),
               block_table.astype(jnp.int32), jnp.arange(0, (b + 1) * t, t, dtype=jnp.int32),
               jnp.asarray([b], jnp.int32), sm_scale=scale, soft_cap=logits_soft_cap,
               sliding_window=None if local_window is None else local_window + 1, **tuning)
  return out.reshape(b, t, n, h).astype(q.dtype)
