"""Gated DeltaNet (Qwen3-Next's "linear_attention" layers): linear attention whose state per
value head is a matrix, written by the delta rule.

Per token: `in_proj_qkvz` makes the queries, keys, values and the output gate z (laid out by
key-head group, as transformers stores it), `in_proj_ba` each value head's write strength b
and decay input a. Queries, keys and values pass a causal depthwise convolution of K taps
(`conv1d`, then SiLU); queries and keys are L2-normed, queries scaled by key_head_dim^-1/2.
Each value head's state S [key_head_dim, value_head_dim] then, per token,

  S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  out = S^T q

with beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias); the output is RMS-normed
per head, times its weight and SiLU(z), then `out_proj`. A sequence runs in chunks of 64
tokens (`chunked_gated_delta_rule`: matmuls and a triangular inverse within a chunk, a scan
across chunks); one decoded token runs the token-by-token rule (`gated_delta_rule`, also the
reference the chunks are tested against).

What a sequence keeps while decoding (`cache_spec`) is per slot, not per token: the state
(float32) and the convolution's last K - 1 inputs. A packed row restarts both at each new
segment; an engine's chunk takes in only its row's `valid` tokens.

Example:
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> from jax_ai_stack.recipes.models.linear_config import LinearAttentionConfig
  >>> shapes = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8,
  ...                                value_head_dim=8)
  >>> layer = GatedDeltaNet(DecoderConfig(), shapes, rngs=nnx.Rngs(0))
  >>> out, _ = layer(jnp.ones((1, 5, 128)))
  >>> out.shape, sorted(layer.cache_spec())
  ((1, 5, 128), ['conv', 'recurrent'])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.recipes.models import eager_sharding_scope
from jax_ai_stack.recipes.models.cache import SLOTS, CacheArray, KVCache, Spec
from jax_ai_stack.recipes.models.cache import put_slot_rows, slot_rows
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.layers import per_replica
from jax_ai_stack.recipes.models.linear_config import LinearAttentionConfig


CHUNK = 64
"""Tokens per chunk of `chunked_gated_delta_rule` (transformers' and FLA's default)."""


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: jax.Array, restart: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
  """The delta rule over T tokens, one at a time (the reference, and one token's decoding):
  q, k [B, T, H, dk], v [B, T, H, dv], g and beta [B, T, H] (float32), the state
  [B, H, dk, dv] before them -> (out [B, T, H, dv], the state after). `restart` [B, T]
  (bool): the state is zeroed before those tokens. A token with g = 0 and beta = 0 leaves the
  state as it is."""
  if restart is None:
    restart = jnp.zeros(g.shape[:2], bool)

  def step(s, token):
    q_t, k_t, v_t, g_t, beta_t, restart_t = token
    s = jnp.where(restart_t[:, None, None, None], 0.0, s * jnp.exp(g_t)[..., None, None])
    delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * beta_t[..., None]
    s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

  time_first = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # noqa: E731
  state, out = jax.lax.scan(step, state.astype(jnp.float32),
                            (*(time_first(x) for x in (q, k, v, g, beta)),
                             jnp.moveaxis(restart, 1, 0)))
  return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                             beta: jax.Array, state: jax.Array, restart: jax.Array | None = None,
                             chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
  """`gated_delta_rule` in chunks of `chunk` tokens: within a chunk its updates are one
  unit lower-triangular inverse and a few matmuls (the UT transform of DeltaNet, as transformers'
  `torch_chunk_gated_delta_rule`), across chunks a scan. A restart splits a chunk into
  segments that neither read nor write each other's state."""
  batch, length, heads = g.shape
  if restart is None:
    restart = jnp.zeros((batch, length), bool)
  pad = -length % chunk
  f32 = lambda x: jnp.pad(x.astype(jnp.float32),  # noqa: E731 - [B, H, N, C, ...]
                          [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  q, k, v, g, beta = (jnp.moveaxis(f32(x), 2, 1) for x in (q, k, v, g, beta))
  q, k, v = (x.reshape(batch, heads, -1, chunk, x.shape[-1]) for x in (q, k, v))
  g, beta = (x.reshape(batch, heads, -1, chunk) for x in (g, beta))
  segment = jnp.cumsum(jnp.pad(restart, ((0, 0), (0, pad))), axis=1).reshape(batch, 1, -1, chunk)
  before = jnp.concatenate([jnp.zeros_like(segment[:, :, :1, :1]), segment[:, :, :-1, -1:]], 2)
  carried = (segment == before).astype(jnp.float32)  # [B, 1, N, C]: reads the state carried in.
  cum = jnp.cumsum(g, axis=-1)
  together = (segment[..., :, None] == segment[..., None, :]) & jnp.tril(
      jnp.ones((chunk, chunk), bool))
  decay = jnp.exp(jnp.where(together, cum[..., :, None] - cum[..., None, :], -jnp.inf))
  k_beta, v_beta = k * beta[..., None], v * beta[..., None]
  inverse = _unit_lower_inverse(jnp.tril(jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * decay,
                                         -1))
  new_values = inverse @ v_beta
  k_carried = inverse @ (k_beta * (jnp.exp(cum) * carried)[..., None])
  within = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * decay
  q_carried = q * (jnp.exp(cum) * carried)[..., None]
  last = segment[..., -1:] == segment  # [B, 1, N, C]: in the chunk's last segment.
  k_out = k * jnp.where(last, jnp.exp(cum[..., -1:] - cum), 0.0)[..., None]
  keeps = jnp.exp(cum[..., -1]) * carried[..., -1]  # [B, H, N]: how much of the state stays.

  def step(s, c):
    values, k_c, q_c, within_c, k_out_c, keep = c
    fresh = values - jnp.einsum("bhik,bhkv->bhiv", k_c, s)
    out = jnp.einsum("bhik,bhkv->bhiv", q_c, s) + jnp.einsum("bhij,bhjv->bhiv", within_c, fresh)
    s = s * keep[..., None, None] + jnp.einsum("bhjk,bhjv->bhkv", k_out_c, fresh)
    return s, out

  chunks = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
  state, out = jax.lax.scan(step, state.astype(jnp.float32), tuple(chunks(x) for x in (
      new_values, k_carried, q_carried, within, k_out, keeps)))
  out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, -1, v.shape[-1])[:, :, :length]
  return jnp.moveaxis(out, 1, 2), state


@jax.custom_vjp
def _unit_lower_inverse(lower: jax.Array) -> jax.Array:
  """(I + lower)^-1 of strictly lower-triangular matrices [..., C, C], row by row (forward
  substitution: XLA:CPU's batched triangular solve is a hundred times slower)."""
  size = lower.shape[-1]

  def row(i, x):
    new = (jnp.arange(size) == i).astype(x.dtype) - jnp.einsum("...j,...jk->...k",
                                                                 lower[..., i, :], x)
    return jax.lax.dynamic_update_index_in_dim(x, new, i, axis=-2)

  return jax.lax.fori_loop(1, size, row, jnp.broadcast_to(jnp.eye(size, dtype=lower.dtype),
                                                          lower.shape))


def _inverse_forward(lower):
  inverse = _unit_lower_inverse(lower)
  return inverse, inverse


def _inverse_backward(inverse, grad):
  """d(M^-1) = -M^-1 dM M^-1: the gradient of M (its strictly lower part) is -X^T G X^T."""
  return (jnp.tril(-jnp.einsum("...ji,...jk,...lk->...il", inverse, grad, inverse), -1),)


_unit_lower_inverse.defvjp(_inverse_forward, _inverse_backward)


def _l2_norm(x: jax.Array) -> jax.Array:
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


class GatedDeltaNet(nnx.Module):
  """One gated DeltaNet layer of `shapes` (see the module); called like `layers.Attention`."""

  def __init__(self, config: DecoderConfig, shapes: LinearAttentionConfig, *, rngs: nnx.Rngs):
    with eager_sharding_scope():  # Built alone (tests, notebooks): no mesh needed.
      self._build(config, shapes, rngs)

  def _build(self, config: DecoderConfig, shapes: LinearAttentionConfig, rngs: nnx.Rngs):
    d, hk, hv = config.d_model, shapes.num_key_heads, shapes.num_value_heads
    dk, dv, r = shapes.key_head_dim, shapes.value_head_dim, hv // hk
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    param_dtype = jnp.dtype(config.param_dtype)
    init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))

    def projection(width: int) -> nnx.Einsum:  # [D, key heads, width]: by key-head group.
      return nnx.Einsum("btd,dng->btng", (d, hk, width), rngs=rngs, **dtypes,
                        kernel_init=nnx.with_partitioning(init, ("embed", None, None)))

    self.in_proj_qkvz = projection(2 * dk + 2 * r * dv)
    self.in_proj_ba = projection(2 * r)
    conv = nnx.initializers.lecun_normal(in_axis=1, out_axis=0)
    self.conv1d = nnx.Param(conv(rngs.params(), (shapes.conv_dim, 1, shapes.conv_kernel),
                                 param_dtype), out_sharding=(None, None, None))
    self.dt_bias = nnx.Param(jnp.ones((hv,), param_dtype), out_sharding=(None,))
    self.A_log = nnx.Param(  # noqa: N815 - transformers' name.
        jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)).astype(
            param_dtype), out_sharding=(None,))
    self.norm = nnx.Param(jnp.ones((dv,), param_dtype), out_sharding=(None,))
    self.out_proj = nnx.Einsum(
        "btnh,nhd->btd", (hv, dv, d), rngs=rngs, **dtypes, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2), (None, None, "embed")))
    self.shapes, self.eps, self.dtype = shapes, config.norm_eps, jnp.dtype(config.dtype)

  def cache_spec(self, paged: bool = True) -> Spec:  # noqa: ARG002 - per slot either way.
    """Per slot, paged engine or contiguous rows alike: the convolution's last K - 1 inputs
    and the state (float32)."""
    s = self.shapes
    return {"conv": CacheArray((SLOTS, s.conv_kernel - 1, s.conv_dim), self.dtype.name),
            "recurrent": CacheArray((SLOTS, s.num_value_heads, s.key_head_dim,
                                     s.value_head_dim), "float32")}

  def __call__(self, x: jax.Array, rope=None, segment_ids: jax.Array | None = None,
               cache: KVCache | None = None) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """x [B, T, D] -> ([B, T, D], this layer's updated cache state, or None). `rope` is not
    used (no positions); `segment_ids` [B, T] restart the state at each new segment; with
    `cache`, each row continues its slot's state (`KVCache.slots`, of its replica where the
    cache has several: `layers.per_replica`) with its first `KVCache.valid` tokens."""
    del rope
    s = self.shapes
    hv, dk, dv, r = s.num_value_heads, s.key_head_dim, s.value_head_dim, s.num_value_heads // (
        s.num_key_heads)
    batch, length = x.shape[:2]
    q, k, v, z = jnp.split(self.in_proj_qkvz(x), [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    b, a = jnp.split(self.in_proj_ba(x), 2, axis=-1)
    mixed = jnp.concatenate([t.reshape(batch, length, -1) for t in (q, k, v)], axis=-1)
    valid = (jnp.full((batch,), length, jnp.int32) if cache is None or cache.valid is None
             else cache.valid)
    taken = (jnp.arange(length)[None, :] < valid[:, None])[..., None]  # This row's own tokens.
    beta = jax.nn.sigmoid(b.reshape(batch, length, hv).astype(jnp.float32)) * taken
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a.reshape(batch, length, hv).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
    rows = (mixed, beta, g * taken, valid,  # Padding: no write, no decay.
            None if segment_ids is None else _starts(segment_ids),
            None if cache is None else cache.slots)
    if cache is None:
      out, state = self._recur(rows, None)
    else:
      out, state = per_replica(self._recur, None, self.cache_spec(), rows, cache.state)
    out = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + self.eps)
    gate = jax.nn.silu(z.reshape(batch, length, hv, dv).astype(jnp.float32))
    out = (self.norm[...] * out.astype(self.dtype)).astype(jnp.float32) * gate
    return self.out_proj(out.astype(self.dtype)), state

  def _recur(self, rows, state):
    """(the value heads' outputs [B, T, Hv, dv], the updated per-slot `state`) of `rows`
    (the convolution's inputs, beta, g, valid, restarts, slots) from `state` (one replica's
    arrays; None: zeros, and None back)."""
    mixed, beta, g, valid, restart, slots = rows
    s = self.shapes
    hk, hv, dk, dv = s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim
    batch, length = mixed.shape[:2]
    if state is None:
      conv_state = jnp.zeros((batch, s.conv_kernel - 1, s.conv_dim), mixed.dtype)
      recurrent = jnp.zeros((batch, hv, dk, dv), jnp.float32)
    else:
      conv_state = slot_rows(state["conv"], slots).astype(mixed.dtype)
      recurrent = slot_rows(state["recurrent"], slots)
    mixed, window = self._convolve(mixed, conv_state, restart, valid)
    q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
    q = _l2_norm(q.reshape(batch, length, hk, dk).astype(jnp.float32)) * dk ** -0.5
    k = _l2_norm(k.reshape(batch, length, hk, dk).astype(jnp.float32))
    q, k = (jnp.repeat(t, hv // hk, axis=2) for t in (q, k))  # Value head h: key head h // r.
    rule = gated_delta_rule if length == 1 else chunked_gated_delta_rule
    out, recurrent = rule(q, k, v.reshape(batch, length, hv, dv), g, beta, recurrent, restart)
    if state is None:
      return out, None
    return out, {"conv": put_slot_rows(state["conv"], slots, window),
                 "recurrent": put_slot_rows(state["recurrent"], slots, recurrent)}

  def _convolve(self, mixed: jax.Array, conv_state: jax.Array, restart, valid):
    """The causal depthwise convolution of `mixed` [B, T, C] after `conv_state` [B, K-1, C]
    (the inputs before it), then SiLU; and the last K - 1 inputs of each row's `valid` ones
    (the next call's state). A tap reaching back past a restart reads zero."""
    taps = self.shapes.conv_kernel
    weight = self.conv1d[...][:, 0, :].astype(jnp.float32)  # [C, K]
    inputs = jnp.concatenate([conv_state, mixed], axis=1).astype(jnp.float32)  # [B, K-1+T, C]
    length = mixed.shape[1]
    segment = None if restart is None else jnp.cumsum(restart, axis=1)
    out = jnp.zeros(mixed.shape, jnp.float32)
    for j in range(taps):  # Output t reads inputs t + j, i.e. token t - (K - 1) + j.
      tap = inputs[:, j:j + length]
      if segment is not None:
        back = taps - 1 - j
        source = jnp.pad(segment, ((0, 0), (back, 0)), constant_values=-1)[:, :length]
        tap = jnp.where((source == segment)[..., None], tap, 0.0)
      out = out + tap * weight[:, j]
    kept = valid[:, None] + jnp.arange(taps - 1)[None, :]  # [B, K-1] into `inputs`.
    window = jnp.take_along_axis(inputs, kept[..., None], axis=1)
    return jax.nn.silu(out).astype(mixed.dtype), window.astype(conv_state.dtype)


def _starts(segment_ids: jax.Array) -> jax.Array:
  """[B, T] bool: the tokens that begin a new segment after another (the first token needs no
  restart: the state starts at zero)."""
  before = jnp.pad(segment_ids, ((0, 0), (1, 0)), constant_values=0)[:, :-1]
  return (segment_ids != before) & (jnp.arange(segment_ids.shape[1]) > 0)[None, :]
