"""`models.layers`: the decoder's MLP on tokens, its norms, and a block's residual form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes.models import block as block_lib
from jax_ai_stack.recipes.models import eager_sharding_scope, layers, rope
from jax_ai_stack.recipes.models.configs import DecoderConfig

SIZES = dict(vocab_size=64, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64,
             max_seq_len=16)
CONFIG = DecoderConfig(**SIZES)


def test_the_mlp_on_tokens_equals_the_mlp_on_each_row():
  with eager_sharding_scope():  # Outside a mesh the axis names stay metadata.
    mlp = layers.MLP(CONFIG, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, 32))
  each = jnp.stack([mlp(x[i:i + 1])[0] for i in range(2)])
  np.testing.assert_allclose(mlp(x), each, rtol=1e-5, atol=1e-6)


def test_an_offset_norm_starts_as_the_plain_norm():
  with eager_sharding_scope():
    plain = layers.rms_norm(CONFIG, nnx.Rngs(0))
    offset = layers.rms_norm(DecoderConfig(kind="gemma2", **SIZES), nnx.Rngs(0))  # Offset 1.
  assert isinstance(offset, layers.OffsetRMSNorm) and float(offset.scale[...].max()) == 0.0
  x = jax.random.normal(jax.random.key(2), (3, 32))
  np.testing.assert_allclose(offset(x), plain(x), rtol=1e-6)


def test_a_block_adds_to_its_input_and_keeps_its_shape():
  plan = kernels.resolve_plan(CONFIG.attention_impl, origin="test", environ={})
  with eager_sharding_scope():
    block = block_lib.Block(CONFIG, plan, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (2, 8, 32))
  tables = rope.rope_tables(jnp.arange(8)[None], CONFIG.resolved_head_dim, CONFIG.rope_theta)
  out, cache, stats = block(x, tables)
  assert out.shape == x.shape and cache is None and stats is None
  assert not np.allclose(out, x)


def _attention(config: DecoderConfig, layer: int = 0) -> layers.Attention:
  plan = kernels.resolve_plan("xla", origin="test", environ={})
  with eager_sharding_scope():
    attention = layers.Attention(config, plan, rngs=nnx.Rngs(0), layer=layer)
  for norm in (attention.q_norm, attention.k_norm):  # Weights off their ones.
    if norm is not None:
      norm.scale[...] = jax.random.uniform(jax.random.key(7), norm.scale.shape, minval=0.5,
                                           maxval=1.5)
  return attention


def _numpy_attention(attention: layers.Attention, x, q_norm=None, k_norm=None, tables=None):
  """Causal grouped-query attention in NumPy from the layer's weights: q/k normed by the given
  functions (None: not), rotated by `tables` (None: NoPE)."""
  w = lambda p: np.asarray(p.kernel[...], np.float64)  # noqa: E731
  x = np.asarray(x, np.float64)
  q, k, v = (np.einsum("btd,dnh->btnh", x, w(p))
             for p in (attention.q_proj, attention.k_proj, attention.v_proj))
  if q_norm is not None:
    q, k = q_norm(q), k_norm(k)
  if tables is not None:
    sin, cos = (np.asarray(t, np.float64) for t in tables[:2])
    half = lambda a: np.split(a, 2, axis=-1)  # noqa: E731
    turn = lambda a: np.concatenate([half(a)[0] * cos - half(a)[1] * sin,  # noqa: E731
                                     half(a)[1] * cos + half(a)[0] * sin], axis=-1)
    q, k = turn(q), turn(k)
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = np.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(q.shape[-1])
  t = x.shape[1]
  logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  out = np.einsum("bnqk,bknh->bqnh", probs, v)
  return np.einsum("btnh,nhd->btd", out, np.asarray(attention.o_proj.kernel[...], np.float64))


def test_a_nope_layer_is_attention_without_rotation():
  """`nope_layers`: the listed layer's attention equals plain causal attention of the
  unrotated q and k; the next layer's rotates them."""
  config = DecoderConfig(kind="smollm3", nope_layers=(0,), **{**SIZES, "num_layers": 2})
  x = jax.random.normal(jax.random.key(4), (2, 7, 32))
  tables = rope.rope_tables(jnp.broadcast_to(jnp.arange(7), (2, 7)), 8, 10_000.0)
  nope, roped = _attention(config, 0), _attention(config, 1)
  np.testing.assert_allclose(nope(x, tables)[0], _numpy_attention(nope, x), atol=2e-5)
  np.testing.assert_allclose(roped(x, tables)[0], _numpy_attention(roped, x, tables=tables),
                             atol=2e-5)
  assert not np.allclose(roped(x, tables)[0], _numpy_attention(roped, x), atol=1e-3)


def test_a_qk_norm_over_the_projection_is_one_rms_over_every_head():
  """`qk_norm_scope="projection"` (OLMo 2): q's RMS is taken over all heads' features at once
  and its weight has heads x head_dim entries; "head" takes it per head."""
  eps = 1e-5

  def rms(scale, per_head):
    scale = np.asarray(scale, np.float64)

    def norm(a):
      flat = a if per_head else a.reshape(*a.shape[:2], -1)
      flat = flat / np.sqrt((flat * flat).mean(-1, keepdims=True) + eps) * scale
      return flat.reshape(a.shape)
    return norm

  x = jax.random.normal(jax.random.key(5), (2, 6, 32))
  tables = rope.rope_tables(jnp.broadcast_to(jnp.arange(6), (2, 6)), 8, 10_000.0)
  whole = _attention(DecoderConfig(kind="olmo2", **SIZES))
  assert whole.q_norm.scale.shape == (4 * 8,) and whole.k_norm.scale.shape == (2 * 8,)
  expected = _numpy_attention(whole, x, rms(whole.q_norm.scale[...], False),
                              rms(whole.k_norm.scale[...], False), tables)
  np.testing.assert_allclose(whole(x, tables)[0], expected, atol=2e-5)
  per_head = _attention(DecoderConfig(kind="qwen3", **SIZES))
  expected = _numpy_attention(per_head, x, rms(per_head.q_norm.scale[...], True),
                              rms(per_head.k_norm.scale[...], True), tables)
  np.testing.assert_allclose(per_head(x, tables)[0], expected, atol=2e-5)


def test_a_block_without_pre_norms_norms_only_its_sublayers_outputs():
  """`pre_norms` off, `post_norms` on (OLMo 2): x + post(attn(x)), then + post(mlp(.))."""
  config = DecoderConfig(kind="olmo2", **SIZES)
  plan = kernels.resolve_plan("xla", origin="test", environ={})
  with eager_sharding_scope():
    block = block_lib.Block(config, plan, rngs=nnx.Rngs(0))
  assert block.attention_norm is None and block.mlp_norm is None
  for norm in (block.post_attention_norm, block.post_mlp_norm):
    norm.scale[...] = jax.random.uniform(jax.random.key(8), norm.scale.shape, minval=0.5,
                                         maxval=1.5)
  x = jax.random.normal(jax.random.key(6), (2, 5, 32))
  tables = rope.rope_tables(jnp.broadcast_to(jnp.arange(5), (2, 5)), 8, 10_000.0)
  h = x + block.post_attention_norm(block.attention(x, tables)[0])
  expected = h + block.post_mlp_norm(block.mlp(h))
  np.testing.assert_allclose(block(x, tables)[0], expected, atol=1e-6)
  assert config.num_params() == sum(
      p.size for p in jax.tree.leaves(nnx.state(block, nnx.Param))) * config.num_layers + (
      config.padded_vocab_size + 1) * config.d_model  # Embedding (tied) and the final norm.


def _numpy_longrope(positions, head_dim, theta, short, long, original, attention_factor):
  """LongRoPE's tables as Phi-3's paper and transformers write them, in NumPy float64."""
  inv = lambda factors: 1.0 / (np.asarray(factors) * theta ** (  # noqa: E731
      np.arange(0, head_dim, 2) / head_dim))
  out_sin, out_cos = [], []
  for row in np.asarray(positions):
    factors = long if row.max() + 1 > original else short
    angles = row[:, None] * inv(factors)
    out_sin.append(np.sin(angles) * attention_factor)
    out_cos.append(np.cos(angles) * attention_factor)
  return np.stack(out_sin)[:, :, None], np.stack(out_cos)[:, :, None]


def test_longrope_tables_follow_each_row_s_longest_position():
  """LongRoPE: a row within original_max_position_embeddings turns by the short factors, a row
  reaching past it by the long ones, both tables scaled by attention_factor."""
  from jax_ai_stack.recipes.models.configs import RopeScaling

  short, long = (1.0, 1.5, 2.0, 4.0), (1.2, 3.0, 6.0, 16.0)
  scaling = RopeScaling(kind="longrope", factor=4.0, original_max_position_embeddings=10,
                        short_factor=short, long_factor=long, attention_factor=1.2)
  positions = jnp.stack([jnp.arange(10), jnp.arange(4, 14)])  # The second row reaches 13.
  tables = rope.rope_tables(positions, 8, 10_000.0, scaling)
  expected = _numpy_longrope(positions, 8, 10_000.0, short, long, 10, 1.2)
  for ours, theirs in zip(tables, expected):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
  plain = rope.rope_tables(positions, 8, 10_000.0)
  assert not np.allclose(tables.cos[0], plain.cos[0] * 1.2)  # The short factors turn too.
  # A padded prompt chunk: the row's last real token (position 8) decides, not the padding's.
  padded = rope.rope_tables(positions, 8, 10_000.0, scaling, longest=jnp.array([9, 8]))
  expected = _numpy_longrope(positions, 8, 10_000.0, short, short, 10, 1.2)
  np.testing.assert_allclose(padded.cos, expected[1], rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"need rotary_dim / 2 = 16 entries each; got 4, 4"):
    DecoderConfig(rope_scaling=scaling)  # head_dim 32


def test_a_partial_rotation_turns_the_first_rotary_dim_features_only():
  """`rotary_dim` (Phi-4-mini's partial_rotary_factor): tables of R/2 angles turn the pairs
  (i, i + R/2) of a head's first R features, as NumPy does; the rest pass unchanged."""
  config = DecoderConfig(kind="phi3", rotary_dim=6, **SIZES)  # head_dim 8.
  x = jax.random.normal(jax.random.key(9), (2, 5, 3, 8))
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  tables = rope.rope_tables(positions, config.rotary_dim, 10_000.0)
  angles = np.arange(5)[:, None] / 10_000.0 ** (np.arange(0, 6, 2) / 6)  # [T, 3]
  sin, cos = np.sin(angles)[None, :, None], np.cos(angles)[None, :, None]
  x64 = np.asarray(x, np.float64)
  a, b = x64[..., :3], x64[..., 3:6]
  expected = np.concatenate([a * cos - b * sin, b * cos + a * sin, x64[..., 6:]], axis=-1)
  np.testing.assert_allclose(rope.rotate(x, tables), expected, atol=1e-5)
  with pytest.raises(ValueError, match="rotary_dim=10 even and at most head_dim"):
    DecoderConfig(kind="phi3", rotary_dim=10, **SIZES)


def test_yarn_s_mscale_sets_the_sine_factor_and_latent_attention_s_softmax_factor():
  """DeepSeek-V3's YaRN (transformers' `_compute_yarn_parameters` and `yarn_apply_mscale`):
  sin and cos times mscale(mscale) / mscale(mscale_all_dim), the softmax scale of latent
  attention times mscale(mscale_all_dim)^2, mscale(m) = 0.1 m ln(factor) + 1; either alone
  leaves the plain YaRN factor."""
  import math

  from jax_ai_stack.recipes.models.configs import RopeScaling

  attention_factor = rope.attention_factor
  both = RopeScaling(kind="yarn", factor=40.0, mscale=0.707, mscale_all_dim=1.0)
  mscale = lambda m: 0.1 * m * math.log(40.0) + 1  # noqa: E731
  assert attention_factor(both) == pytest.approx(mscale(0.707) / mscale(1.0))
  assert both.softmax_factor == pytest.approx(mscale(1.0) ** 2)
  alone = RopeScaling(kind="yarn", factor=40.0, mscale=0.707)
  assert attention_factor(alone) == pytest.approx(mscale(1.0)) and alone.softmax_factor == 1.0
  short = RopeScaling(kind="yarn", factor=1.0, mscale=1.0, mscale_all_dim=1.0)
  assert attention_factor(short) == 1.0 and short.softmax_factor == 1.0
