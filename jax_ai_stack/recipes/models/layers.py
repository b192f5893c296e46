"""The decoder's layers: attention with its KV cache, the SwiGLU MLP, the norms.

`decoder.Decoder` stacks blocks (`block.Block`) between the embedding and the head; each
block is [norm -> grouped-query attention with RoPE (or `latent_attention`) -> residual;
norm -> MLP (or a mixture of experts, `moe`) -> residual], with the optional norms after
each sublayer that Gemma adds. The parameters' logical axis names are the decoder's
(`decoder.LOGICAL_AXES`); the hidden states [B, T, D] are pinned to
`HIDDEN_AXES` under a mesh (`constrain`).

Example:
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models import eager_sharding_scope
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> with eager_sharding_scope():  # No mesh: the logical axis names stay metadata.
  ...   mlp = MLP(DecoderConfig.tiny(), rngs=nnx.Rngs(0))
  >>> mlp(jnp.ones((2, 3, 128))).shape
  (2, 3, 128)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ai_stack import kernels
from jax_ai_stack.kernels.paged import OPAQUE, paged_attention
from jax_ai_stack.kernels.paged_tpu import fused_pool, pallas_tpu, tpu_kernel_takes
from jax_ai_stack.recipes.models.cache import (HEADS, LENGTH, PAGE_SIZE, PAGES, SLOTS,
                                                CacheArray, KVCache, Spec, replicated)
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.mlp import MLP, on_tokens  # noqa: F401 - re-exported
from jax_ai_stack.recipes.models.rope import RopeTables, rotate

if TYPE_CHECKING:
  from jax_ai_stack.recipes.sharding import Layout

HIDDEN_AXES = ("batch", "length", None)
"""Logical names of the hidden states [B, T, D]. D stays whole: the parameters'
"embed" is split over fsdp, which the batch already uses."""



def _fan_in_init(in_axis, out_axis):
  """Lecun-normal for kernels whose fan-in spans several (or leading) axes."""
  return nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
  )


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE; k/v have `num_kv_heads` heads.

  The config's switches: biases on q/k/v (`qkv_bias`) and on the output (`o_proj_bias`),
  an RMSNorm over each head of q and k before RoPE (`qk_norm`; over the whole projection
  with `qk_norm_scope` "projection"), the logits' scale and soft cap, `layer`'s sliding
  window, its chunks (`attention_chunk_size`) and a sink logit per head (`attention_sinks`)
  (the kernels get the last five through their request), whether it rotates q and k at all
  (`nope_layers`), and Llama 4's L2 norm of q and k after RoPE (`qk_l2_norm`) or, in a NoPE
  layer, its queries' temperature (`nope_temperature`).
  """

  def __init__(self, config: DecoderConfig, attention: kernels.AttentionPlan, *, rngs: nnx.Rngs,
               sharding: kernels.AttentionSharding | None = None, layer: int = 0):
    d, n, k, h = (
        config.d_model, config.num_heads, config.num_kv_heads, config.resolved_head_dim
    )
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    in_init = _fan_in_init(in_axis=0, out_axis=(1, 2))

    def projection(heads: int, axis: str, width: int = h) -> nnx.Einsum:
      bias = dict(bias_shape=(heads, width), bias_init=nnx.with_partitioning(
          nnx.initializers.zeros, (axis, "head_dim"))) if config.qkv_bias else {}
      return nnx.Einsum(
          "btd,dnh->btnh", (d, heads, width), rngs=rngs, **dtypes, **bias,
          kernel_init=nnx.with_partitioning(in_init, ("embed", axis, "head_dim")),
      )

    self.output_gate = config.attention_output_gate  # q_proj's heads: [q, gate] each.
    self.q_proj = projection(n, "heads", 2 * h if self.output_gate else h)
    self.k_proj = projection(k, "kv_heads")
    self.v_proj = projection(k, "kv_heads")
    out_bias = dict(bias_shape=(d,), bias_init=nnx.with_partitioning(
        nnx.initializers.zeros, ("embed",))) if config.o_proj_bias else {}
    self.o_proj = nnx.Einsum(
        "btnh,nhd->btd", (n, h, d), rngs=rngs, **dtypes, **out_bias,
        kernel_init=nnx.with_partitioning(
            _fan_in_init(in_axis=(0, 1), out_axis=2), ("heads", "head_dim", "embed")
        ),
    )
    self.sinks = nnx.Param(jnp.zeros((n,), jnp.dtype(config.param_dtype)),
                           out_sharding=("heads",)) if config.attention_sinks else None
    self.qk_norm_heads = config.qk_norm_scope == "projection"
    if config.qk_norm:  # Over one head's features, or over all heads' at once.
      self.q_norm = rms_norm(config, rngs, n * h if self.qk_norm_heads else h)
      self.k_norm = rms_norm(config, rngs, k * h if self.qk_norm_heads else h)
    else:
      self.q_norm = self.k_norm = None
    self.use_rope = layer not in config.nope_layers
    self.l2_norm = config.norm_eps if config.qk_l2_norm and self.use_rope else None
    self.temperature = None if self.use_rope else config.nope_temperature
    self.chunk_size = config.chunk_size(layer)
    self.attention_plan = attention
    self.attention_sharding = sharding
    self.local_window = config.local_window(layer)
    self.logits_soft_cap = config.attn_logit_softcap
    self.scale = config.attention_scale
    self.cache_shape = (k, h, config.dtype)
    """Key/value heads, head_dim and dtype of its cache (`cache_spec`)."""

  def _qk_norm(self, norm: nnx.RMSNorm, x: jax.Array) -> jax.Array:
    """`norm` of x [B, T, N, H] over each head's H features, or (`qk_norm_scope`
    "projection") over all N * H at once."""
    if not self.qk_norm_heads:
      return norm(x)
    return norm(x.reshape(*x.shape[:-2], -1)).reshape(x.shape)

  def _attend(self, q, k, v, *, causal, segment_ids=None, kv_seq_lengths=None,
              local_window=None):
    return kernels.attention(
        q, k, v, causal=causal, segment_ids=segment_ids, kv_seq_lengths=kv_seq_lengths,
        local_window=local_window, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
        sinks=self._sinks(), chunk_size=self.chunk_size, plan=self.attention_plan,
        sharding=self.attention_sharding,
    )

  def _after_rope(self, q, k, rope: RopeTables):
    """Llama 4's: q and k over their RMS (`qk_l2_norm`, RoPE layers), or a NoPE layer's
    queries scaled by the temperature of their positions (`nope_temperature`)."""
    if self.l2_norm is not None:
      q, k = l2_norm(q, self.l2_norm), l2_norm(k, self.l2_norm)
    if self.temperature is not None:
      floor_scale, attn_scale = self.temperature
      at = rope.positions.astype(jnp.float32)[:, :, None, None]
      scale = jnp.log1p(jnp.floor((at + 1.0) / floor_scale)) * attn_scale + 1.0
      q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return q, k

  def cache_spec(self, paged: bool = True) -> Spec:
    """What this layer caches for decoding: its keys and values, paged (the engine's pools
    [K, pages, page_size, H], `kernels.paged`; for the TPU's kernel one pool in its own
    layout, `_fused_pool`) or one contiguous row per sequence [B, S, K, H]
    (`Decoder.init_cache`). The decoder lays them out (`cache.lay_out`); nobody else reads
    the names."""
    heads, head_dim, dtype = self.cache_shape
    if paged and self._fused_pool():
      return {"kv": CacheArray((PAGES, PAGE_SIZE, 2 * heads, head_dim), dtype,
                               (None, None, HEADS, None))}
    dims = ((heads, PAGES, PAGE_SIZE, head_dim) if paged else
            (SLOTS, LENGTH, heads, head_dim))
    axes = (HEADS, None, None, None) if paged else (None, None, HEADS, None)
    array = CacheArray(dims, dtype, axes)
    return {"keys": array, "values": array}

  def _fused_pool(self) -> bool:
    """Whether the engine's pool is the TPU kernel's own layout, [pages, page_size, 2 * K, H]
    with each head's keys and values side by side: where the plan decodes with pallas_tpu
    and the kernel takes each device's heads (split whole over `tensor`, so a device holds
    pairs). Otherwise the kernel's adapter would copy every page a row reads into that
    layout in each layer at each step (`kernels.paged_tpu.fuse_pages`, docs/kernels.md)."""
    if self._paged_attention() != "pallas_tpu":
      return False
    heads, head_dim, dtype = self.cache_shape
    sharding = self.attention_sharding
    ways = 1 if sharding is None else sharding.size(sharding.heads)
    return heads % ways == 0 and tpu_kernel_takes(head_dim, heads // ways, dtype)

  def _sinks(self) -> jax.Array | None:
    return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

  def __call__(
      self,
      x: jax.Array,
      rope: RopeTables,
      segment_ids: jax.Array | None = None,
      cache: KVCache | None = None,
  ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """x [B, T, D] -> ([B, T, D], this layer's updated cache state, or None).

    `rope`: the tables of the tokens' positions (`rope_tables`).

    With `cache` (its `state` this layer's, as `cache_spec` lays it out): the new keys and
    values are written at `cache.length`. Contiguous (no block table): T > 1 is a prefill
    and must start an empty cache (length 0); T == 1 decodes one token that attends to the
    first length + 1 cached positions (with a sliding window, to the last `window + 1` of
    them, read as one slice). Paged (`KVCache.block_table`): length [B], T tokens per row
    (a chunk of a prompt, or one) written at length[i] ... and attending causally to all
    the row's positions before.
    """
    q, k = self.q_proj(x), self.k_proj(x)
    gate = None
    if self.output_gate:
      q, gate = jnp.split(q, 2, axis=-1)
    if self.q_norm is not None:
      q, k = self._qk_norm(self.q_norm, q), self._qk_norm(self.k_norm, k)
    if self.use_rope:
      q, k = rotate(q, rope), rotate(k, rope)
    q, k = self._after_rope(q, k, rope)
    v = self.v_proj(x)
    window = self.local_window
    if cache is None:
      out = self._attend(q, k, v, causal=True, segment_ids=segment_ids, local_window=window)
      return self._output(out, gate), None
    if cache.block_table is not None:
      out, state = self._decode_pages(q, k, v, cache)
      return self._output(out, gate), state
    keys, values, length = cache.state["keys"], cache.state["values"], cache.length
    keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), length, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(
        values, v.astype(values.dtype), length, axis=1
    )
    if x.shape[1] > 1:  # Prefill: nothing precedes the prompt, so its own keys suffice.
      out = self._attend(q, k, v, causal=True, local_window=window)
    elif window is not None and keys.shape[1] > window + 1 and self.chunk_size is None:
      start = jnp.maximum(length - window, 0)  # The window's keys: one fixed-size slice.
      seen = jnp.full((x.shape[0],), length - start + 1, dtype=jnp.int32)
      recent = (jax.lax.dynamic_slice_in_dim(c, start, window + 1, axis=1) for c in (keys, values))
      out = self._attend(q, *recent, causal=False, kv_seq_lengths=seen)
    else:
      seen = jnp.full((x.shape[0],), length + 1, dtype=jnp.int32)
      out = self._attend(q, keys, values, causal=False, kv_seq_lengths=seen)
    return self._output(out, gate), {"keys": keys, "values": values}

  def _output(self, out: jax.Array, gate: jax.Array | None) -> jax.Array:
    """o_proj of the heads' outputs [B, T, N, H], gated by sigmoid(gate) first where q_proj
    makes one (`attention_output_gate`)."""
    if gate is not None:
      out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    return self.o_proj(out)

  def _paged_attention(self) -> str:
    """The paged attention the plan chooses for its backend (the devices compiled for)."""
    if self.attention_plan is None:
      return "auto"
    return self.attention_plan.paged_attention(sinks=self.sinks is not None,
                                               chunked=self.chunk_size is not None)[0]

  def _decode_pages(self, q, k, v, cache: KVCache):
    """T tokens per row at positions length[i] ... over pools of pages (one per replica:
    `per_replica`); (the heads' outputs, the updated pools)."""
    scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
    attend = functools.partial(_write_and_attend, scale=scale,
                               logits_soft_cap=self.logits_soft_cap,
                               local_window=self.local_window, sinks=self._sinks(),
                               chunk_size=self.chunk_size,
                               implementation=self._paged_attention())
    rows = (q, k, v, cache.length, cache.block_table)
    spec = {name: array for name, array in self.cache_spec().items() if name in cache.state}
    heads = (2, 2, 2, None, None) if self._paged_attention() in OPAQUE else None
    return per_replica(attend, self.attention_sharding, spec, rows, cache.state, heads=heads)


def _write_and_attend(rows, state, **options):
  """Each row's new keys and values k, v [B, T, K, H] written into the page that holds their
  position (a position past the row's table goes to page 0, which the engine never hands
  out), then `kernels.paged.paged_attention` (`options`) of q, or over a pool in the TPU
  kernel's layout (`Attention._fused_pool`) that kernel itself: (out, the updated state)."""
  q, k, v, length, block_table = rows
  positions = length[:, None] + jnp.arange(q.shape[1])  # [B, T]
  if "kv" in state:  # The TPU kernel's own layout [pages, page_size, 2K, H].
    pool = state["kv"]
    page = jnp.take_along_axis(block_table, positions // pool.shape[1], axis=1, mode="fill",
                               fill_value=0)
    pool = pool.at[page, positions % pool.shape[1]].set(fused_pool(k, v).astype(pool.dtype))
    out = pallas_tpu(q, pool, block_table, positions, scale=options["scale"],
                     logits_soft_cap=options["logits_soft_cap"],
                     local_window=options["local_window"])
    return out, {"kv": pool}
  keys, values = state["keys"], state["values"]
  page_size = keys.shape[2]  # Pools [K, pages, page_size, H].
  page = jnp.take_along_axis(block_table, positions // page_size, axis=1, mode="fill",
                             fill_value=0)
  put = lambda pool, new: pool.at[:, page, positions % page_size].set(
      jnp.moveaxis(new, 2, 0).astype(pool.dtype))  # new [B, T, K, H] as [K, B, T, H].
  keys, values = put(keys, k), put(values, v)
  out = paged_attention(q, keys, values, block_table, positions, **options)
  return out, {"keys": keys, "values": values}


def per_replica(attend: Callable, sharding: kernels.AttentionSharding | None, spec: Spec,
                rows: tuple[jax.Array, ...], state: dict[str, jax.Array], *,
                heads: tuple[int | None, ...] | None = None):
  """`attend(rows, state) -> (out, state)` (as `_write_and_attend`) over a layer's cache
  (`spec`'s arrays, with a replica axis where it has several replicas, `cache.lay_out`):
  `rows` (arrays whose first axis is the batch's) in R equal groups, each over its
  replica's part; the plain call for one.

  On a mesh whose batch axes split the rows into R groups (a data-parallel engine), each
  group runs where its rows and its pool live, in a `shard_map` over those axes: no page
  crosses devices, whatever the kernel (GSPMD cannot split a Pallas kernel's call, and
  given one pool split by pages, read with global page numbers, it all-reduces every page
  read across the replicas). Elsewhere the groups run side by side (`vmap`).

  `heads` (per row, the dimension of its heads, or None) says `attend` calls a kernel XLA
  cannot partition over any axis (a Pallas kernel: `kernels.paged.OPAQUE`): on a mesh it
  then runs manual over every axis, the rows' and pools' heads split over the heads axes
  (tensor) where the pools' key/value heads divide, else whole on every device.
  """
  axes = {name: array.replica_axis() for name, array in spec.items()}
  name = next(iter(axes))
  several = replicated(spec, state)
  replicas, count = state[name].shape[axes[name]] if several else 1, rows[0].shape[0]
  if count % replicas:
    raise ValueError(f"{count} rows do not split into the pools' {replicas} replicas")

  def groups(rows, state):
    if not several:
      return attend(rows, state)
    groups = state[name].shape[axes[name]]
    if groups == 1:
      out, state = attend(rows, {n: jnp.squeeze(a, axes[n]) for n, a in state.items()})
      return out, {n: jnp.expand_dims(a, axes[n]) for n, a in state.items()}
    split = lambda x: x.reshape(groups, -1, *x.shape[1:])
    out, state = jax.vmap(attend, in_axes=(0, axes), out_axes=(0, axes))(
        jax.tree.map(split, rows), state)
    return out.reshape(-1, *out.shape[2:]), state

  opaque = heads is not None and sharding is not None and sharding.mesh.size > 1
  by_replica = sharding is not None and replicas > 1 and sharding.size(sharding.batch) == replicas
  if not (opaque or by_replica):
    return groups(rows, state)
  batch = sharding.batch if by_replica else None
  ways = sharding.size(sharding.heads)
  split = opaque and ways > 1 and all(
      size % ways == 0 for array in spec.values()
      for size, axis in zip(array.shape, array.axes) if axis == HEADS)
  split_heads = sharding.heads if split else None

  def row_spec(row, head_dim):
    return P(batch, *(split_heads if d == head_dim else None for d in range(1, row.ndim)))

  def pool_spec(array: CacheArray):
    dims = [split_heads if axis == HEADS else None for axis in array.axes]
    if several:
      dims.insert(array.replica_axis(), batch)
    return P(*dims)

  by_rows = tuple(row_spec(row, (heads or (None,) * len(rows))[i]) for i, row in enumerate(rows))
  by_pools = {n: pool_spec(array) for n, array in spec.items()}
  # Manual over the mesh's axes of one device too: a Mosaic kernel (the TPU's ragged paged
  # attention) refuses to be partitioned automatically, even over an axis of size 1. And
  # check_vma=False: that opaque call declares outputs with no varying axes.
  manual = (set(sharding.mesh.axis_names) if opaque else
            set(sharding.batch) | {a for a, n in sharding.mesh.shape.items() if n == 1})
  return jax.shard_map(groups, mesh=sharding.mesh, axis_names=manual,
                       in_specs=(by_rows, by_pools),
                       out_specs=(by_rows[0] if opaque else P(batch), by_pools),
                       check_vma=False)(rows, state)


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
  """x over its RMS along the last axis, x / sqrt(mean(x^2) + eps), in float32, without a
  weight (Llama 4's `Llama4TextL2Norm`, which is an RMSNorm despite its name)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class OffsetRMSNorm(nnx.RMSNorm):
  """RMSNorm scaled by (offset + weight), in float32: Gemma's `x * (1 + w)` with offset 1.

  The weight starts at 1 - offset, so a new norm is the identity as Llama's is.
  """

  def __init__(self, num_features: int, *, offset: float, **kwargs):
    super().__init__(num_features, **kwargs)
    self.offset = offset

  def __call__(self, x, mask=None):
    del mask
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    y = y * (self.offset + self.scale[...].astype(jnp.float32))
    return y.astype(self.dtype or x.dtype)


def rms_norm(config: DecoderConfig, rngs: nnx.Rngs, features: int | None = None) -> nnx.RMSNorm:
  """An RMSNorm over `features` (default d_model) with the config's eps and `norm_offset`."""
  kwargs = dict(epsilon=config.norm_eps, rngs=rngs, dtype=jnp.dtype(config.dtype),
                param_dtype=jnp.dtype(config.param_dtype))
  features = config.d_model if features is None else features
  if not config.norm_offset:
    return nnx.RMSNorm(features, **kwargs, scale_init=nnx.with_partitioning(
        nnx.initializers.ones, ("norm",)))
  start = nnx.initializers.constant(1.0 - config.norm_offset)
  return OffsetRMSNorm(features, offset=config.norm_offset, **kwargs,
                       scale_init=nnx.with_partitioning(start, ("norm",)))


def constrain(layout: Layout | None, x: jax.Array) -> jax.Array:
  """Hidden states [B, T, D] pinned where `layout` says; as they are without one."""
  return x if layout is None else layout.constrain(x, HIDDEN_AXES)
