"""The decoder's layers: attention with its KV cache, the SwiGLU MLP, the norms, a block.

`decoder.Decoder` stacks `Block`s between the embedding and the head; each block
is [norm -> grouped-query attention with RoPE -> residual; norm -> MLP (or a
mixture of experts, `moe`) -> residual], with the optional norms after each
sublayer that Gemma adds. The parameters' logical axis names are the decoder's
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
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_ai_stack import kernels
from jax_ai_stack.kernels.paged import paged_attention
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.moe import ACTIVATIONS, MoE
from jax_ai_stack.recipes.models.rope import RopeTables, rotate

if TYPE_CHECKING:
  from jax_ai_stack.recipes.sharding import Layout

HIDDEN_AXES = ("batch", "length", None)
"""Logical names of the hidden states [B, T, D]. D stays whole: the parameters'
"embed" is split over fsdp, which the batch already uses."""



class KVCache(NamedTuple):
  """Keys and values of every layer; the first `length` positions are filled.

  keys[i] and values[i] are [B, S, num_kv_heads, head_dim] for layer i: a tuple
  of arrays, or one stacked array [num_layers, B, S, ...] with `scan_layers`.
  """

  keys: tuple[jax.Array, ...] | jax.Array
  values: tuple[jax.Array, ...] | jax.Array
  length: jax.Array
  """int32: a scalar (every row holds as many tokens), or [B], one per row, with a
  `block_table` only."""
  block_table: jax.Array | None = None
  """Paged (the generation engine's): int32 [B, W], row b's positions j * page_size ... in
  page block_table[b, j] of keys[i] and values[i], which are then pools of pages
  [num_kv_heads, pages, page_size, head_dim] (stacked: [num_layers, ...]); `length`
  is [B]: row i's T tokens go to positions length[i] ... (a chunk of its prompt, or one).
  Pools [num_kv_heads, R, pages, page_size, head_dim] are one per replica: the rows are R
  equal groups in order, group r's table numbering the pages of pool r
  (`Decoder.init_pages`)."""


def _fan_in_init(in_axis, out_axis):
  """Lecun-normal for kernels whose fan-in spans several (or leading) axes."""
  return nnx.initializers.variance_scaling(
      1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis
  )


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE; k/v have `num_kv_heads` heads.

  The config's switches: biases on q/k/v (`qkv_bias`), an RMSNorm over each head
  of q and k before RoPE (`qk_norm`), the logits' scale and soft cap, and
  `layer`'s sliding window; the kernels get all three through their request.
  """

  def __init__(self, config: DecoderConfig, attention: kernels.AttentionPlan, *, rngs: nnx.Rngs,
               sharding: kernels.AttentionSharding | None = None, layer: int = 0):
    d, n, k, h = (
        config.d_model, config.num_heads, config.num_kv_heads, config.resolved_head_dim
    )
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    in_init = _fan_in_init(in_axis=0, out_axis=(1, 2))

    def projection(heads: int, axis: str) -> nnx.Einsum:
      bias = dict(bias_shape=(heads, h), bias_init=nnx.with_partitioning(
          nnx.initializers.zeros, (axis, "head_dim"))) if config.qkv_bias else {}
      return nnx.Einsum(
          "btd,dnh->btnh", (d, heads, h), rngs=rngs, **dtypes, **bias,
          kernel_init=nnx.with_partitioning(in_init, ("embed", axis, "head_dim")),
      )

    self.q_proj = projection(n, "heads")
    self.k_proj = projection(k, "kv_heads")
    self.v_proj = projection(k, "kv_heads")
    self.o_proj = nnx.Einsum(
        "btnh,nhd->btd", (n, h, d), rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(
            _fan_in_init(in_axis=(0, 1), out_axis=2), ("heads", "head_dim", "embed")
        ),
    )
    if config.qk_norm:
      self.q_norm = rms_norm(config, rngs, h)
      self.k_norm = rms_norm(config, rngs, h)
    else:
      self.q_norm = self.k_norm = None
    self.attention_plan = attention
    self.attention_sharding = sharding
    self.local_window = config.local_window(layer)
    self.logits_soft_cap = config.attn_logit_softcap
    self.scale = config.attention_scale

  def _attend(self, q, k, v, *, causal, segment_ids=None, kv_seq_lengths=None,
              local_window=None):
    return kernels.attention(
        q, k, v, causal=causal, segment_ids=segment_ids, kv_seq_lengths=kv_seq_lengths,
        local_window=local_window, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
        plan=self.attention_plan, sharding=self.attention_sharding,
    )

  def __call__(
      self,
      x: jax.Array,
      rope: RopeTables,
      segment_ids: jax.Array | None = None,
      cache: tuple[jax.Array, ...] | None = None,
  ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """x [B, T, D] -> ([B, T, D], updated (keys, values) or None).

    `rope`: the tables of the tokens' positions (`rope_tables`).

    With `cache` = (keys, values, length): the new keys/values are written at
    `length`. T > 1 is a prefill and must start an empty cache (length 0); T == 1
    decodes one token that attends to the first length + 1 cached positions
    (with a sliding window, to the last `window + 1` of them, read as one slice).
    (keys, values, length, block_table): pools of pages (`KVCache.block_table`), length [B],
    T tokens per row (a chunk of a prompt, or one) written at length[i] ... and attending
    causally to all the row's positions before.
    """
    q, k = self.q_proj(x), self.k_proj(x)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rotate(q, rope), rotate(k, rope)
    v = self.v_proj(x)
    window = self.local_window
    if cache is None:
      out = self._attend(q, k, v, causal=True, segment_ids=segment_ids, local_window=window)
      return self.o_proj(out), None
    keys, values, length = cache[:3]
    if len(cache) > 3 and cache[3] is not None:
      return self._decode_pages(q, k, v, keys, values, length, cache[3])
    keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), length, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(
        values, v.astype(values.dtype), length, axis=1
    )
    if x.shape[1] > 1:  # Prefill: nothing precedes the prompt, so its own keys suffice.
      out = self._attend(q, k, v, causal=True, local_window=window)
    elif window is not None and keys.shape[1] > window + 1:
      start = jnp.maximum(length - window, 0)  # The window's keys: one fixed-size slice.
      seen = jnp.full((x.shape[0],), length - start + 1, dtype=jnp.int32)
      recent = (jax.lax.dynamic_slice_in_dim(c, start, window + 1, axis=1) for c in (keys, values))
      out = self._attend(q, *recent, causal=False, kv_seq_lengths=seen)
    else:
      seen = jnp.full((x.shape[0],), length + 1, dtype=jnp.int32)
      out = self._attend(q, keys, values, causal=False, kv_seq_lengths=seen)
    return self.o_proj(out), (keys, values)

  def _paged_attention(self) -> str:
    """The paged attention the plan chooses for its backend (the devices compiled for)."""
    return self.attention_plan.paged_attention()[0] if self.attention_plan else "auto"

  def _decode_pages(self, q, k, v, keys, values, length, block_table):
    """T tokens per row at positions length[i] ... over pools of pages (one per replica:
    `replicated_pages`), then the output projection."""
    scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
    attend = functools.partial(_write_and_attend, scale=scale,
                               logits_soft_cap=self.logits_soft_cap,
                               local_window=self.local_window,
                               implementation=self._paged_attention())
    if keys.ndim == 5:
      out, keys, values = replicated_pages(attend, self.attention_sharding, q, k, v, keys,
                                           values, length, block_table)
    else:
      out, keys, values = attend(q, k, v, keys, values, length, block_table)
    return self.o_proj(out), (keys, values)


def _write_and_attend(q, k, v, keys, values, length, block_table, **options):
  """Each row's new keys and values k, v [B, T, K, H] written into the page that holds their
  position (a position past the row's table goes to page 0, which the engine never hands
  out), then `kernels.paged.paged_attention` (`options`) of q: (out, keys, values)."""
  page_size = keys.shape[2]  # Pools [K, pages, page_size, H].
  positions = length[:, None] + jnp.arange(q.shape[1])  # [B, T]
  page = jnp.take_along_axis(block_table, positions // page_size, axis=1, mode="fill",
                             fill_value=0)
  put = lambda pool, new: pool.at[:, page, positions % page_size].set(
      jnp.moveaxis(new, 2, 0).astype(pool.dtype))  # new [B, T, K, H] as [K, B, T, H].
  keys, values = put(keys, k), put(values, v)
  return paged_attention(q, keys, values, block_table, positions, **options), keys, values


def replicated_pages(attend: Callable, sharding: kernels.AttentionSharding | None, q, k, v,
                     keys, values, length, block_table):
  """`attend` (as `_write_and_attend`) with pools of pages per replica, keys and values
  [K, R, pages, P, H]: rows in R equal groups, each over its own pool.

  On a mesh whose batch axes split the rows into R groups (a data-parallel engine), each
  group runs where its rows and its pool live, in a `shard_map` over those axes: no page
  crosses devices, whatever the kernel (GSPMD cannot split a Pallas kernel's call, and
  given one pool split by pages, read with global page numbers, it all-reduces every page
  read across the replicas). Elsewhere the groups run side by side (`vmap`; one group is
  the plain call).
  """
  replicas, rows = keys.shape[1], q.shape[0]
  if rows % replicas:
    raise ValueError(f"{rows} rows do not split into the pools' {replicas} replicas")

  def groups(q, k, v, keys, values, length, block_table):
    count = keys.shape[1]
    if count == 1:
      out, keys, values = attend(q, k, v, keys[:, 0], values[:, 0], length, block_table)
      return out, keys[:, None], values[:, None]
    split = lambda x: x.reshape(count, -1, *x.shape[1:])
    out, keys, values = jax.vmap(attend, in_axes=(0, 0, 0, 1, 1, 0, 0), out_axes=(0, 1, 1))(
        split(q), split(k), split(v), keys, values, split(length), split(block_table))
    return out.reshape(-1, *out.shape[2:]), keys, values

  if sharding is None or replicas == 1 or sharding.size(sharding.batch) != replicas:
    return groups(q, k, v, keys, values, length, block_table)
  by_rows, by_pools = P(sharding.batch), P(None, sharding.batch)
  # Manual over the mesh's axes of one device too: a Mosaic kernel (the TPU's ragged paged
  # attention) refuses to be partitioned automatically, even over an axis of size 1. And
  # check_vma=False: that opaque call declares outputs with no varying axes.
  manual = set(sharding.batch) | {a for a, n in sharding.mesh.shape.items() if n == 1}
  return jax.shard_map(groups, mesh=sharding.mesh, axis_names=manual,
                       in_specs=(by_rows,) * 3 + (by_pools,) * 2 + (by_rows,) * 2,
                       out_specs=(by_rows, by_pools, by_pools), check_vma=False)(
                           q, k, v, keys, values, length, block_table)


def on_tokens(layer: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """`layer(x)` applied to x [..., D] as one [tokens, D] matrix, reshaped back.

  The same forward values, but a dense layer's weight gradient becomes one
  plain matmul: on a 3-D input XLA:CPU contracts the batch and sequence axes with
  layout copies around the dot (the tiny Llama's MLP forward+backward took 17 ms
  3-D, 10 ms flattened; the whole step 15-20% less; the gradients sum in another
  order, so their last bits differ). A reshape of the leading axes costs nothing,
  on a mesh too (the batch axis stays the sharded one).
  """
  y = layer(x.reshape(-1, x.shape[-1]))
  return y.reshape(*x.shape[:-1], y.shape[-1])


class MLP(nnx.Module):
  """A gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_tanh."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    d, f = config.d_model, config.mlp_dim
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    init = nnx.initializers.lecun_normal()
    self.gate_proj = nnx.Linear(
        d, f, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
    )
    self.up_proj = nnx.Linear(
        d, f, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
    )
    self.down_proj = nnx.Linear(
        f, d, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
    )
    self.activation = config.mlp_activation

  def __call__(self, x: jax.Array) -> jax.Array:
    act = ACTIVATIONS[self.activation]
    return on_tokens(lambda x: self.down_proj(act(self.gate_proj(x)) * self.up_proj(x)), x)


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


class Block(nnx.Module):
  """One pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)).

  With `post_norms` (Gemma 2/3) each branch's output is normed before its add.
  The MLP is a mixture of experts (`moe.MoE`) in the layers `config.moe_layers`
  names; the block then also returns the layer's `moe.MoeStats` (else None).
  """

  def __init__(self, config: DecoderConfig, attention: kernels.AttentionPlan, *, rngs: nnx.Rngs,
               layout: Layout | None = None, layer: int = 0):
    self.attention_norm = rms_norm(config, rngs)
    self.attention = Attention(config, attention, rngs=rngs, layer=layer,
                               sharding=layout.attention() if layout else None)
    self.mlp_norm = rms_norm(config, rngs)
    platform = attention.backend.platform if attention and attention.backend else None
    self.mlp = (MoE(config, rngs=rngs, layout=layout, platform=platform)
                if config.moe_layers[layer] else MLP(config, rngs=rngs))
    if config.post_norms:
      self.post_attention_norm = rms_norm(config, rngs)
      self.post_mlp_norm = rms_norm(config, rngs)
    else:
      self.post_attention_norm = self.post_mlp_norm = None
    self.layout = layout

  def __call__(self, x, rope: RopeTables, segment_ids=None, cache=None):
    h, new_cache = self.attention(self.attention_norm(x), rope, segment_ids, cache)
    if self.post_attention_norm is not None:
      h = self.post_attention_norm(h)
    x = x + constrain(self.layout, h)
    if isinstance(self.mlp, MoE):
      h, stats = self.mlp(self.mlp_norm(x), segment_ids)
    else:
      h, stats = self.mlp(self.mlp_norm(x)), None
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return x + constrain(self.layout, h), new_cache, stats



def constrain(layout: Layout | None, x: jax.Array) -> jax.Array:
  """Hidden states [B, T, D] pinned where `layout` says; as they are without one."""
  return x if layout is None else layout.constrain(x, HIDDEN_AXES)
