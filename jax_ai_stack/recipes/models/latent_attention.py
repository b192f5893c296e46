"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values made from one
low-rank latent per token, and that latent, not keys and values, in the cache.

Training and a prompt's first pass compute each head's keys and values from the latent,
as the model is written:

  q       = q_b(norm(q_a(x)))  (or q_proj(x))         [B, T, N, nope + rope]
  latent  = norm(kv_a(x)[:r]), k_rope = kv_a(x)[r:]   [B, T, r], [B, T, rope]: one per token
  k, v    = kv_b(latent) split                        [B, T, N, nope], [B, T, N, v]
  keys    = [k, RoPE(k_rope) for every head], queries = [q_nope, RoPE(q_rope)]

Decoding reads the cache, which holds [latent, RoPE(k_rope)] a token (`cached_features`), and
never makes keys or values: kv_b's key half is absorbed into the queries (q_nope . k =
(q_nope W_uk^T) . latent), so the cached rows are the keys of one shared head, and their
latent part the values, whose weighted sum kv_b's value half takes to each head's v. One
array serves as keys and values: the attention's output past the latent's r features is
dropped. So the paged kernels and the contiguous cache's attention run unchanged, on one key
head of r + rope features.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models import eager_sharding_scope
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> from jax_ai_stack.recipes.models.latent_config import LatentAttentionConfig
  >>> from jax_ai_stack.recipes.models.rope import rope_tables
  >>> shapes = LatentAttentionConfig(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
  ...                                qk_rope_head_dim=4, v_head_dim=8)
  >>> with eager_sharding_scope():
  ...   attention = LatentAttention(DecoderConfig.tiny(), shapes, None, rngs=nnx.Rngs(0))
  >>> rope = rope_tables(jnp.arange(3)[None], 4, 10_000.0)
  >>> out, _ = attention(jnp.ones((1, 3, 128)), rope)
  >>> out.shape, attention.cache_spec()["latent"].shape
  ((1, 3, 128), (1, 'pages', 'page_size', 20))
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.kernels.paged import OPAQUE, paged_attention
from jax_ai_stack.recipes.models.cache import (LENGTH, PAGE_SIZE, PAGES, SLOTS, CacheArray,
                                                KVCache, Spec)
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.latent_config import LatentAttentionConfig
from jax_ai_stack.recipes.models.layers import _fan_in_init, per_replica, rms_norm
from jax_ai_stack.recipes.models.rope import RopeTables, rotate


class LatentAttention(nnx.Module):
  """Multi-head latent attention with `config.num_heads` heads of `shapes`' sizes; the
  call and cache interface of `layers.Attention`."""

  def __init__(self, config: DecoderConfig, shapes: LatentAttentionConfig,
               attention: kernels.AttentionPlan | None, *, rngs: nnx.Rngs,
               sharding: kernels.AttentionSharding | None = None, layer: int = 0):
    del layer  # Every layer alike (DeepSeek's have no windows).
    d, n, r = config.d_model, config.num_heads, shapes.kv_lora_rank
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))

    def down(features: int) -> nnx.Linear:  # d_model -> a latent, split like the stream.
      return nnx.Linear(d, features, use_bias=False, rngs=rngs, **dtypes,
                        kernel_init=nnx.with_partitioning(
                            nnx.initializers.lecun_normal(), ("embed", None)))

    def up(rank: int, features: int) -> nnx.Einsum:  # To each head: split like q_proj.
      return nnx.Einsum("btr,rnh->btnh", (rank, n, features), rngs=rngs, **dtypes,
                        kernel_init=nnx.with_partitioning(
                            _fan_in_init(in_axis=0, out_axis=(1, 2)),
                            ("embed", "heads", "head_dim")))

    if shapes.q_lora_rank is None:
      self.q_proj = up(d, shapes.qk_head_dim)
      self.q_a_proj = self.q_norm = self.q_b_proj = None
    else:
      self.q_proj = None
      self.q_a_proj = down(shapes.q_lora_rank)
      self.q_norm = rms_norm(config, rngs, shapes.q_lora_rank)
      self.q_b_proj = up(shapes.q_lora_rank, shapes.qk_head_dim)
    self.kv_a_proj = down(r + shapes.qk_rope_head_dim)
    self.kv_norm = rms_norm(config, rngs, r)
    self.kv_b_proj = up(r, shapes.qk_nope_head_dim + shapes.v_head_dim)
    self.o_proj = nnx.Einsum(
        "btnh,nhd->btd", (n, shapes.v_head_dim, d), rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(_fan_in_init(in_axis=(0, 1), out_axis=2),
                                          ("heads", "head_dim", "embed")))
    self.shapes = shapes
    self.attention_plan = attention
    self.attention_sharding = sharding
    self.scale = (config.attention_scale if config.attention_scale is not None
                  else shapes.qk_head_dim ** -0.5)
    if config.rope_scaling is not None:  # YaRN's mscale_all_dim (DeepSeek-V3's long context).
      self.scale *= config.rope_scaling.softmax_factor
    self.cache_dtype = config.dtype

  def cache_spec(self, paged: bool = True) -> Spec:
    """One array a layer: each token's latent and RoPE key (`cached_features`), as one key
    head, paged [1, pages, page_size, F] (the paged kernels' layout) or contiguous
    [B, S, 1, F]. Not split over the mesh: every head reads all of it."""
    features = self.shapes.cached_features
    dims = (1, PAGES, PAGE_SIZE, features) if paged else (SLOTS, LENGTH, 1, features)
    return {"latent": CacheArray(dims, self.cache_dtype)}

  def _queries(self, x: jax.Array, rope: RopeTables) -> tuple[jax.Array, jax.Array]:
    """(q_nope [B, T, N, nope], RoPE(q_rope) [B, T, N, rope])."""
    if self.q_proj is not None:
      q = self.q_proj(x)
    else:
      q = self.q_b_proj(self.q_norm(self.q_a_proj(x)))
    nope = self.shapes.qk_nope_head_dim
    return q[..., :nope], rotate(q[..., nope:], rope)

  def _latent(self, x: jax.Array, rope: RopeTables) -> jax.Array:
    """What the cache holds a token: [norm(latent), RoPE(k_rope)] [B, T, 1, r + rope]."""
    both = self.kv_a_proj(x)
    r = self.shapes.kv_lora_rank
    latent = self.kv_norm(both[..., :r])
    k_rope = rotate(both[..., None, r:], rope)
    return jnp.concatenate([latent[..., None, :], k_rope.astype(latent.dtype)], axis=-1)

  def _up_weights(self) -> tuple[jax.Array, jax.Array]:
    """kv_b's key half W_uk [r, N, nope] and value half W_uv [r, N, v]."""
    kernel = self.kv_b_proj.kernel[...].astype(jnp.dtype(self.cache_dtype))
    nope = self.shapes.qk_nope_head_dim
    return kernel[..., :nope], kernel[..., nope:]

  def _attend(self, q, k, v, **options) -> jax.Array:
    return kernels.attention(q, k, v, scale=self.scale, plan=self.attention_plan,
                             sharding=self.attention_sharding, **options)

  def __call__(self, x: jax.Array, rope: RopeTables, segment_ids: jax.Array | None = None,
               cache: KVCache | None = None) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """x [B, T, D] -> ([B, T, D], this layer's updated cache state, or None), as
    `layers.Attention`: `rope` the tables of `qk_rope_head_dim` features; with `cache` the
    tokens' latents are written at `cache.length` (contiguous: a prefill of T > 1 from an
    empty cache, or one token; paged: T tokens a row after its positions)."""
    q_nope, q_rope = self._queries(x, rope)
    cached = self._latent(x, rope)  # [B, T, 1, r + rope]
    if cache is None or (cache.block_table is None and x.shape[1] > 1):
      out = self._expanded(q_nope, q_rope, cached, segment_ids)
      if cache is None:
        return out, None
      pool = jax.lax.dynamic_update_slice_in_dim(
          cache.state["latent"], cached.astype(cache.state["latent"].dtype), cache.length, axis=1)
      return out, {"latent": pool}
    queries = self._absorbed(q_nope, q_rope)
    if cache.block_table is not None:
      return self._decode_pages(queries, cached, cache)
    pool = jax.lax.dynamic_update_slice_in_dim(
        cache.state["latent"], cached.astype(cache.state["latent"].dtype), cache.length, axis=1)
    seen = jnp.full((x.shape[0],), cache.length + 1, dtype=jnp.int32)
    out = self._attend(queries, pool, pool, causal=False, kv_seq_lengths=seen)
    return self._output(out), {"latent": pool}

  def _expanded(self, q_nope, q_rope, cached, segment_ids) -> jax.Array:
    """Causal attention over the tokens' own keys and values, made from their latents."""
    r, nope = self.shapes.kv_lora_rank, self.shapes.qk_nope_head_dim
    kv = self.kv_b_proj(cached[..., 0, :r])  # [B, T, N, nope + v]
    heads = kv.shape[2]
    k_rope = jnp.broadcast_to(cached[..., r:], (*kv.shape[:2], heads, cached.shape[-1] - r))
    q = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
    k = jnp.concatenate([kv[..., :nope], k_rope.astype(kv.dtype)], axis=-1)
    v = kv[..., nope:]
    width = q.shape[-1]  # The kernels take one head size: the values padded to it.
    if v.shape[-1] < width:
      v = jnp.pad(v, ((0, 0),) * 3 + ((0, width - v.shape[-1]),))
    out = self._attend(q, k, v, causal=True, segment_ids=segment_ids)
    return self.o_proj(out[..., :self.shapes.v_head_dim])

  def _absorbed(self, q_nope: jax.Array, q_rope: jax.Array) -> jax.Array:
    """Queries against the cached rows: [q_nope W_uk^T, q_rope] [B, T, N, r + rope]."""
    w_uk, _ = self._up_weights()
    q_latent = jnp.einsum("btnh,rnh->btnr", q_nope, w_uk.astype(q_nope.dtype))
    return jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)

  def _output(self, out: jax.Array) -> jax.Array:
    """The attention's weighted latents [B, T, N, r (+ rope, dropped)] to the stream."""
    _, w_uv = self._up_weights()
    r = self.shapes.kv_lora_rank
    values = jnp.einsum("btnr,rnv->btnv", out[..., :r], w_uv.astype(out.dtype))
    return self.o_proj(values)

  def _decode_pages(self, queries, cached, cache: KVCache):
    """T tokens a row at positions length[i] ... over the pool of latents (one per replica:
    `layers.per_replica`); (out, the updated pool)."""
    attend = functools.partial(_write_and_attend, scale=self.scale,
                               implementation=self._paged_attention())
    rows = (queries, cached, cache.length, cache.block_table)
    heads = (2, 2, None, None) if self._paged_attention() in OPAQUE else None
    out, state = per_replica(attend, self.attention_sharding, self.cache_spec(), rows,
                             cache.state, heads=heads)
    return self._output(out), state

  def _paged_attention(self) -> str:
    """The paged attention the plan chooses for its backend (as `layers.Attention`'s)."""
    if self.attention_plan is None:
      return "auto"
    return self.attention_plan.paged_attention()[0]


def _write_and_attend(rows, state, **options):
  """Each row's new cached rows [B, T, 1, F] written into the pages of their positions, then
  `paged_attention` of the queries over the pool as keys and values: (out, the state)."""
  queries, cached, length, block_table = rows
  pool = state["latent"]  # [1, pages, page_size, F]
  page_size = pool.shape[2]
  positions = length[:, None] + jnp.arange(queries.shape[1])
  page = jnp.take_along_axis(block_table, positions // page_size, axis=1, mode="fill",
                             fill_value=0)
  pool = pool.at[:, page, positions % page_size].set(
      jnp.moveaxis(cached, 2, 0).astype(pool.dtype))
  out = paged_attention(queries, pool, pool, block_table, positions, **options)
  return out, {"latent": pool}
