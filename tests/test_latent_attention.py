"""Multi-head latent attention against a NumPy reference of DeepSeek's formulation (keys and
values made from each token's latent), and its decoding over a cache of latents alone
(kv_b absorbed into the queries), contiguous and paged, against its own full pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.recipes.models import eager_sharding_scope
from jax_ai_stack.recipes.models.cache import KVCache, lay_out
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.latent_attention import LatentAttention
from jax_ai_stack.recipes.models.latent_config import LatentAttentionConfig
from jax_ai_stack.recipes.models.rope import rope_tables

THETA = 10_000.0
CONFIG = DecoderConfig.tiny(d_model=32, num_heads=4)


def shapes(q_lora_rank):
  return LatentAttentionConfig(kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_nope_head_dim=8,
                               qk_rope_head_dim=4, v_head_dim=6)


def build(q_lora_rank) -> LatentAttention:
  with eager_sharding_scope():
    return LatentAttention(CONFIG, shapes(q_lora_rank), None, rngs=nnx.Rngs(0))


def rope(positions, dims):
  return rope_tables(jnp.asarray(positions, jnp.int32), dims, THETA)


def np_rms(x, scale, eps=CONFIG.norm_eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rope(x, positions):
  """Rotate-half RoPE of x [B, T, N, H] at positions [B, T]."""
  half = x.shape[-1] // 2
  angles = positions[:, :, None, None] * THETA ** (-np.arange(half) * 2 / x.shape[-1])
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                         x2 * np.cos(angles) + x1 * np.sin(angles)], axis=-1)


def reference(layer: LatentAttention, x: np.ndarray) -> np.ndarray:
  """DeepSeek-V3's attention written out: every head's keys and values made whole."""
  s = layer.shapes
  w = lambda module: np.asarray(module.kernel[...], np.float64)
  b, t, _ = x.shape
  positions = np.broadcast_to(np.arange(t), (b, t)).astype(np.float64)
  if layer.q_proj is not None:
    q = np.einsum("btd,dnh->btnh", x, w(layer.q_proj))
  else:
    latent_q = np_rms(x @ w(layer.q_a_proj), np.asarray(layer.q_norm.scale[...]))
    q = np.einsum("btr,rnh->btnh", latent_q, w(layer.q_b_proj))
  both = x @ w(layer.kv_a_proj)
  latent = np_rms(both[..., :s.kv_lora_rank], np.asarray(layer.kv_norm.scale[...]))
  kv = np.einsum("btr,rnh->btnh", latent, w(layer.kv_b_proj))
  heads = q.shape[2]
  k_rope = np.repeat(np_rope(both[..., None, s.kv_lora_rank:], positions), heads, axis=2)
  q = np.concatenate([q[..., :s.qk_nope_head_dim],
                      np_rope(q[..., s.qk_nope_head_dim:], positions)], axis=-1)
  k = np.concatenate([kv[..., :s.qk_nope_head_dim], k_rope], axis=-1)
  v = kv[..., s.qk_nope_head_dim:]
  logits = np.einsum("bqnh,bknh->bnqk", q, k) * s.qk_head_dim ** -0.5
  logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("bnqk,bknv->bqnv", weights, v)
  return np.einsum("bqnv,nvd->bqd", out, w(layer.o_proj))


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_the_full_pass_is_deepseek_s_attention(q_lora_rank):
  layer = build(q_lora_rank)
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 7, CONFIG.d_model)))
  out, state = layer(jnp.asarray(x), rope(np.broadcast_to(np.arange(7), (2, 7)), 4))
  assert state is None
  np.testing.assert_allclose(np.asarray(out), reference(layer, x.astype(np.float64)),
                             atol=2e-5, rtol=2e-5)


def test_a_layer_caches_the_latent_and_one_rope_key_a_token():
  spec = build(None).cache_spec()
  assert spec["latent"].shape == (1, "pages", "page_size", 16 + 4)
  assert spec["latent"].bytes({"pages": 1, "page_size": 1}) == (16 + 4) * 4  # float32
  assert build(None).cache_spec(paged=False)["latent"].shape == ("slots", "length", 1, 20)


def full_pass(layer, tokens):
  b, t = tokens.shape[:2]
  out, _ = layer(tokens, rope(np.broadcast_to(np.arange(t), (b, t)), 4))
  return np.asarray(out)


def test_decoding_over_a_contiguous_cache_of_latents_is_the_full_pass():
  layer = build(12)
  x = jax.random.normal(jax.random.key(2), (2, 6, CONFIG.d_model))
  state = lay_out([layer.cache_spec(paged=False)], {"slots": 2, "length": 8}, stacked=False)[0]
  positions = np.broadcast_to(np.arange(4), (2, 4))
  _, state = layer(x[:, :4], rope(positions, 4), cache=KVCache(state, jnp.int32(0)))
  outs = []
  for at in (4, 5):  # One token at a time after the prompt: kv_b absorbed.
    out, state = layer(x[:, at:at + 1], rope(np.full((2, 1), at), 4),
                       cache=KVCache(state, jnp.int32(at)))
    outs.append(np.asarray(out))
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full_pass(layer, x)[:, 4:],
                             atol=2e-5, rtol=2e-5)


def test_decoding_over_pages_of_latents_is_the_full_pass():
  layer = build(None)
  x = jax.random.normal(jax.random.key(3), (2, 7, CONFIG.d_model))
  state = lay_out([layer.cache_spec()], {"pages": 9, "page_size": 2}, stacked=False)[0]
  table = jnp.asarray([[1, 3, 5, 7], [2, 4, 6, 8]], jnp.int32)  # Page 0 is never handed out.
  length = jnp.zeros((2,), jnp.int32)
  outs = []
  for start, stop in ((0, 3), (3, 5), (5, 6), (6, 7)):  # Chunks of the prompt, then tokens.
    positions = np.broadcast_to(np.arange(start, stop), (2, stop - start))
    out, state = layer(x[:, start:stop], rope(positions, 4),
                       cache=KVCache(state, length, block_table=table))
    outs.append(np.asarray(out))
    length = length + (stop - start)
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full_pass(layer, x),
                             atol=2e-5, rtol=2e-5)
