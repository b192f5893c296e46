"""Attention over a paged KV cache: plain XLA, one page of keys at a time.

The generation engine keeps keys and values in a pool of fixed-size pages, and each
row (a request) has a block table: the pool's pages that hold its positions, in
order. A row's queries (one when decoding, a chunk of its prompt when prefilling) sit
at given positions and attend causally to the row's positions up to their own.

The pages are read one table column at a time in a loop, with an online softmax
(a running maximum, sum and weighted values, rescaled as each page arrives), for as
many columns as the rows' furthest position needs, so a call's work follows the
tokens its rows hold, however wide the table. A page past a query's position (or
before its sliding window) is masked whole and adds exactly nothing: its weights are
exp(-inf) = 0 and the running maximum does not move (a rescale by exp(0) = 1). So a
row's result does not depend on how many pages are read: a request gives the same bits
beside short rows or long ones.

Where a row's page is large (`GROUP_FLOATS`), the rows go in groups of equal size,
longest first, each group's loop as long as its own longest row: short rows stop
reading early. A row's bits depend on the group size (the batched matmuls' shape),
which the row count and page shape fix, never on which rows share its group.

Implementations ("auto": pallas_gpu on GPU, pallas_tpu on TPU, else xla), as
`choose_paged_attention` says (what `jax-ai-stack kernels` reports). A model does not
choose at trace time: its `AttentionPlan.paged_attention()` chooses for the plan's backend
(the devices the run is compiled for), and the model passes that name here:

  pallas_gpu  JAX's Pallas paged-attention kernel for GPUs
              (`jax.experimental.pallas.ops.gpu.paged_attention`; interpret mode elsewhere),
              for one query per row and no sliding window; other calls (a prompt's chunk,
              a sliding-window layer) fall back to xla
  pallas_tpu  JAX's Pallas ragged paged-attention kernel for TPUs
              (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`: decoding and
              chunks of prompts, sliding windows, soft caps), for head_dim a multiple of
              128 and key/value heads the kernel can tile; other calls fall back to xla.
              TPUs only: JAX's TPU interpret mode cannot run this kernel (jax 0.10.2 and
              0.12.0.1 fail on its reshaped refs), so on CPU the tests run the adapter
              with the kernel's own reference (`ref_ragged_paged_attention`) in its place
  xla         the loop over pages above, everywhere; the one that takes attention sinks and chunks

The pools' layout is the GPU kernel's: [kv_heads, pages, page_size, head_dim]. The TPU
kernel reads its own (`paged_tpu`: a model decoding with it lays its pool out so; pools of
this layout are copied into it in every call). On a mesh a Pallas kernel runs in a
`shard_map` over every axis (`OPAQUE`), the heads split over `tensor`.

Example: one query at position 2 (it sees 3 keys) over pages of 2 positions (pages 1, 2).
  >>> import jax.numpy as jnp
  >>> pool = jnp.ones((1, 3, 2, 4))  # [kv_heads, pages, page_size, head_dim]
  >>> out = paged_attention(jnp.ones((1, 1, 2, 4)), pool, pool, jnp.asarray([[1, 2]]),
  ...                       jnp.asarray([[2]]), scale=0.5)
  >>> out.shape, float(out[0, 0, 0, 0])
  ((1, 1, 2, 4), 1.0)
  >>> choose_paged_attention("auto", "cpu")[0]
  'xla'
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_ai_stack.kernels import names, rules
from jax_ai_stack.kernels.paged_tpu import fuse_pages, pallas_tpu, tpu_kernel_fits
from jax_ai_stack.kernels.request import Backend, target_backend

__all__ = ["GROUP_FLOATS", "OPAQUE", "PAGED_ATTENTIONS", "choose_paged_attention",
           "paged_attention"]

GROUP_FLOATS = 32768
"""The xla loop's rows go in groups, halved while each reads at least this many floats of keys
a page (XLA:CPU pays a fixed time a loop step): the benchmark's 25M model (2 x 64 x 64 a row)
decodes in groups of 4 rows, its attention 1.6x as fast; its tiny one keeps its 16 rows."""

PAGED_ATTENTIONS = ("pallas_gpu", "pallas_tpu", "xla")
OPAQUE = ("pallas_gpu", "pallas_tpu")
"""Kernels XLA cannot partition (Pallas calls): on a mesh a model runs them inside a
`shard_map` over every axis (`layers.per_replica`)."""
_WHY = {"pallas_gpu": "JAX's Pallas paged-attention kernel (one query per row, no sliding "
                      "window; other calls fall back to xla)",
        "pallas_tpu": "JAX's Pallas ragged paged-attention kernel (head_dim a multiple of "
                      "128; other calls fall back to xla)",
        "xla": "a loop over the pages with an online softmax, in XLA"}
_AUTO = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}


def choose_paged_attention(requested: str = "auto", platform: str | None = None,
                           device_kind: str | None = None, *, sinks: bool = False,
                           chunked: bool = False) -> tuple[str, str]:
  """(implementation, why) for `requested` ("auto" or one of `PAGED_ATTENTIONS`) on
  `platform` and `device_kind` (None: the devices traced for, `request.target_backend`), for a
  model with sinks or chunks (xla: the kernels take neither). ValueError names the choices."""
  refused = "attention sinks" if sinks else "chunked attention (chunk_size)" if chunked else ""
  if refused and (chosen := choose_paged_attention(requested, platform, device_kind))[0] != "xla":
    return "xla", f"{chosen[0]} refused: {refused} not supported; {_WHY['xla']}"
  chosen = names.requested(requested, PAGED_ATTENTIONS, _WHY, "paged attention")
  if chosen is not None:
    return chosen
  if platform is None:
    backend = target_backend()
    platform, device_kind = backend.platform, backend.device_kind
  name = _AUTO.get(platform, "xla")
  generation = rules.tpu_generation(Backend(platform, device_kind or ""))
  if name == "pallas_tpu" and generation is not None and generation < 4:
    return "xla", (f"auto on {device_kind}: JAX's ragged paged-attention kernel has block "
                   f"sizes for TPU v4 and newer only; {_WHY['xla']}")
  return name, f"auto on {platform}: {_WHY[name]}"


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    block_table: jax.Array, positions: jax.Array, *, scale: float,
                    logits_soft_cap: float | None = None, local_window: int | None = None,
                    sinks: jax.Array | None = None, implementation: str = "auto",
                    chunk_size: int | None = None) -> jax.Array:
  """Each row's queries over its pages.

  q [B, T, N, H]; k_pages, v_pages [K, pages, page_size, H] (N a multiple of K: grouped
  queries); block_table [B, W] int32, row b's positions j * page_size ... in page
  block_table[b, j]; positions [B, T]: query t of row b sits at positions[b, t] and
  attends to the row's positions up to it, with `local_window` w to the last w + 1 of
  them (`chunk_size` C: of its chunk only, C * (p // C) ... p); `sinks` [N]: each query
  head's sink logit joins its softmax's denominator. Returns [B, T, N, H] in q's dtype.
  """
  name, _ = choose_paged_attention(implementation, sinks=sinks is not None, chunked=bool(chunk_size))
  if name == "pallas_gpu" and q.shape[1] == 1 and local_window is None:
    return _pallas_gpu(q, k_pages, v_pages, block_table, positions, scale, logits_soft_cap)
  if name == "pallas_tpu" and tpu_kernel_fits(q, k_pages):
    return pallas_tpu(q, *fuse_pages(k_pages, v_pages, block_table), positions, scale=scale,
                      logits_soft_cap=logits_soft_cap, local_window=local_window)
  return _xla(q, k_pages, v_pages, block_table, positions, scale, logits_soft_cap,
              local_window, sinks, chunk_size)


def _pallas_gpu(q, k_pages, v_pages, block_table, positions, scale, logits_soft_cap):
  """One query per row through JAX's Pallas kernel (which scales nothing itself)."""
  from jax.experimental.pallas.ops.gpu import paged_attention as pallas

  width = block_table.shape[1]
  splits = math.gcd(16, width)  # The kernel needs splits | width and blocks | width / splits.
  out = pallas.paged_attention(
      (q[:, 0] * scale).astype(q.dtype), k_pages, v_pages, block_table, positions[:, 0] + 1,
      k_splits=splits, pages_per_compute_block=math.gcd(8, width // splits),
      attn_logits_soft_cap=logits_soft_cap, interpret=jax.default_backend() != "gpu")
  return out[:, None]


def _xla(q, k_pages, v_pages, block_table, positions, scale, logits_soft_cap, local_window,
         sinks=None, chunk_size=None):
  b, t, n, h = q.shape
  k, page_size = k_pages.shape[0], k_pages.shape[2]
  g = n // k
  # [K, B, T * G, H]: each key/value head's queries together, so that a page's logits and
  # weighted values are plain batched matmuls over (K, B) with the pages' [K, B, P, H]
  # (1.3x-1.7x faster on CPU than with the queries' own axis order, for chunks of prompts).
  queries = jnp.moveaxis(q.reshape(b, t, k, g, h), 2, 0).reshape(k, b, t * g, h)
  queries = queries.astype(jnp.float32) * scale
  last = jnp.repeat(positions, g, axis=1)[None, :, :, None]  # [1, B, T * G, 1]: own position.
  first = jnp.zeros_like(last) if local_window is None else last - local_window
  first = first if chunk_size is None else jnp.maximum(first, last // chunk_size * chunk_size)
  # The table columns each row reads: up to its furthest query's position.
  columns = jnp.minimum(positions.max(axis=1) // page_size + 1, block_table.shape[1])
  rows = _group_rows(b, k * page_size * h)
  attend = functools.partial(_online_softmax, k_pages=k_pages, v_pages=v_pages,
                             logits_soft_cap=logits_soft_cap)
  if sinks is not None:  # [K, B, T * G], as the queries: head k * G + g's sink.
    sinks = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(k, 1, 1, g),
                             (k, b, t, g)).reshape(k, b, t * g)
  if rows == b:
    out = attend(queries, last, first, block_table, columns.max(), sinks)
  else:
    order = jnp.argsort(-columns, stable=True).reshape(-1, rows)  # Longest first.
    outs = [attend(queries[:, group], last[:, group], first[:, group], block_table[group],
                   columns[group].max(), None if sinks is None else sinks[:, group])
            for group in order]
    out = jnp.concatenate(outs, axis=1)[:, jnp.argsort(order.reshape(-1))]
  out = out.reshape(k, b, t, g, h)
  return jnp.moveaxis(out, 0, 2).reshape(b, t, n, h).astype(q.dtype)


def _group_rows(rows: int, row_floats: int) -> int:
  """Rows per group of the xla loop (`GROUP_FLOATS`; `row_floats` a row)."""
  size = rows
  while size % 2 == 0 and size // 2 * row_floats >= GROUP_FLOATS:
    size //= 2
  return size


def _online_softmax(queries, last, first, block_table, columns, sinks=None, *, k_pages,
                    v_pages, logits_soft_cap):
  """queries [K, B, Q, H] (scaled, float32) over the first `columns` (traced) columns of
  `block_table` [B, W], keys at or before `last` and at or after `first` ([1, B, Q, 1]),
  `sinks` [K, B, Q] in the denominator if given: the attention's output [K, B, Q, H]."""
  page_size = k_pages.shape[2]
  offsets = jnp.arange(page_size)

  def page(column, carry):
    top, total, weighted = carry  # [K, B, Q], the same, [K, B, Q, H]
    pages = block_table[:, column]
    keys = k_pages[:, pages].astype(jnp.float32)  # [K, B, P, H]
    values = v_pages[:, pages].astype(jnp.float32)
    logits = jnp.einsum("kbqh,kbph->kbqp", queries, keys)
    if logits_soft_cap is not None:
      logits = jnp.tanh(logits / logits_soft_cap) * logits_soft_cap
    keys_at = column * page_size + offsets
    seen = (keys_at <= last) & (keys_at >= first)  # [1, B, Q, P]
    logits = jnp.where(seen, logits, -jnp.inf)
    new_top = jnp.maximum(top, logits.max(-1))
    # A query that has seen nothing yet keeps -inf: rescale by 1, not exp(-inf + inf).
    rescale = jnp.where(new_top == -jnp.inf, 1.0, jnp.exp(top - new_top))
    weights = jnp.where(seen, jnp.exp(logits - new_top[..., None]), 0.0)
    total = total * rescale + weights.sum(-1)
    weighted = weighted * rescale[..., None] + jnp.einsum("kbqp,kbph->kbqh", weights, values)
    return new_top, total, weighted

  # Made from the queries, so that inside a shard_map the carry varies as they do.
  start = (jnp.full_like(queries[..., 0], -jnp.inf), jnp.zeros_like(queries[..., 0]),
           jnp.zeros_like(queries))
  top, total, weighted = jax.lax.fori_loop(0, columns, page, start)
  if sinks is not None:  # Every query sees its own position: top is finite.
    new_top = jnp.maximum(top, sinks)
    total = total * jnp.exp(top - new_top) + jnp.exp(sinks - new_top)
    weighted = weighted * jnp.exp(top - new_top)[..., None]
  return weighted / total[..., None]
