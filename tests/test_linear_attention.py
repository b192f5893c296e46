"""Gated DeltaNet (Qwen3-Next's linear attention) against a NumPy reference of the layer written
token by token, and its decoding from a per-slot state: token by token, in chunks with
padding (the engine's `valid`), and a packed row's segments each from a fresh state.
(Its family against transformers: tests/test_families.py, test_engine.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.recipes.models.cache import KVCache, lay_out
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.linear_attention import (
    GatedDeltaNet, chunked_gated_delta_rule, gated_delta_rule)
from jax_ai_stack.recipes.models.linear_config import LinearAttentionConfig

CONFIG = DecoderConfig.tiny(d_model=32)
SHAPES = LinearAttentionConfig(num_key_heads=2, num_value_heads=4, key_head_dim=8,
                               value_head_dim=6, conv_kernel=4)
RNG = np.random.default_rng(0)


def build() -> GatedDeltaNet:
  layer = GatedDeltaNet(CONFIG, SHAPES, rngs=nnx.Rngs(0))
  for name in ("dt_bias", "norm"):  # Off their inits of ones, so that each shows.
    param = getattr(layer, name)
    param[...] = param[...] + jnp.asarray(RNG.normal(size=param.shape) * 0.3, jnp.float32)
  return layer


@nnx.jit
def run(layer, x, segment_ids=None, cache=None):
  """The layer's call, compiled (eagerly, each of its small ops would dispatch on its own)."""
  return layer(x, segment_ids=segment_ids, cache=cache)


def silu(x):
  return x / (1 + np.exp(-x))


def reference(layer: GatedDeltaNet, x: np.ndarray) -> np.ndarray:
  """The layer as Qwen3-Next writes it (`torch_recurrent_gated_delta_rule`), token by token."""
  s, f64 = SHAPES, lambda a: np.asarray(a[...], np.float64)
  hk, hv, dk, dv, r = (s.num_key_heads, s.num_value_heads, s.key_head_dim, s.value_head_dim,
                       s.num_value_heads // s.num_key_heads)
  b, t, _ = x.shape
  qkvz = np.einsum("btd,dng->btng", x, f64(layer.in_proj_qkvz.kernel))
  ba = np.einsum("btd,dng->btng", x, f64(layer.in_proj_ba.kernel))
  q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
  beta = 1 / (1 + np.exp(-ba[..., :r].reshape(b, t, hv)))
  a = ba[..., r:].reshape(b, t, hv)
  g = -np.exp(f64(layer.A_log)) * np.log1p(np.exp(a + f64(layer.dt_bias)))
  mixed = np.concatenate([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], -1)
  weight = f64(layer.conv1d)[:, 0]  # [C, K]: output t reads tokens t - K + 1 ... t.
  padded = np.pad(mixed, ((0, 0), (s.conv_kernel - 1, 0), (0, 0)))
  mixed = silu(sum(padded[:, j:j + t] * weight[:, j] for j in range(s.conv_kernel)))
  q, k, v = np.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
  norm = lambda u: u / np.sqrt((u * u).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
  q = np.repeat(norm(q.reshape(b, t, hk, dk)), r, axis=2) / np.sqrt(dk)
  k = np.repeat(norm(k.reshape(b, t, hk, dk)), r, axis=2)
  v = v.reshape(b, t, hv, dv)
  state, out = np.zeros((b, hv, dk, dv)), np.zeros((b, t, hv, dv))
  for i in range(t):
    state = state * np.exp(g[:, i])[..., None, None]
    delta = (v[:, i] - np.einsum("bhkv,bhk->bhv", state, k[:, i])) * beta[:, i, :, None]
    state = state + np.einsum("bhk,bhv->bhkv", k[:, i], delta)
    out[:, i] = np.einsum("bhkv,bhk->bhv", state, q[:, i])
  out = out / np.sqrt((out * out).mean(-1, keepdims=True) + CONFIG.norm_eps) * f64(layer.norm)
  out = out * silu(z.reshape(b, t, hv, dv))
  return np.einsum("btnh,nhd->btd", out, f64(layer.out_proj.kernel))


def test_the_full_pass_is_qwen3_next_s_gated_delta_rule():
  layer = build()
  x = RNG.normal(size=(2, 9, 32))
  out, state = run(layer, jnp.asarray(x, jnp.float32))
  assert state is None
  np.testing.assert_allclose(np.asarray(out), reference(layer, x), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [4, 64])
def test_the_chunked_rule_equals_the_token_by_token_one(chunk):
  """Across chunks, with restarts inside and across chunk edges, from a state, and with
  tokens that write nothing (an engine's padding: g = 0, beta = 0)."""
  b, t, h, dk, dv = 2, 37, 3, 8, 6
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q = jnp.asarray(unit(RNG.normal(size=(b, t, h, dk))) * dk ** -0.5, jnp.float32)
  k = jnp.asarray(unit(RNG.normal(size=(b, t, h, dk))), jnp.float32)
  v = jnp.asarray(RNG.normal(size=(b, t, h, dv)), jnp.float32)
  written = RNG.uniform(size=(b, t, 1)) < 0.8
  g = jnp.asarray(-np.abs(RNG.normal(size=(b, t, h))) * 0.3 * written, jnp.float32)
  beta = jnp.asarray(RNG.uniform(size=(b, t, h)) * written, jnp.float32)
  state = jnp.asarray(RNG.normal(size=(b, h, dk, dv)), jnp.float32)
  restart = jnp.asarray(RNG.uniform(size=(b, t)) < 0.1).at[:, 4].set(True)
  for starts in (None, restart):
    expected = gated_delta_rule(q, k, v, g, beta, state, starts)
    got = chunked_gated_delta_rule(q, k, v, g, beta, state, starts, chunk=chunk)
    for ours, theirs in zip(got, expected):
      np.testing.assert_allclose(ours, theirs, atol=2e-6)
  weights = jnp.asarray(RNG.normal(size=(b, t, h, dv)), jnp.float32)  # Its gradients too.
  grads = [jax.jit(jax.grad(lambda *x, rule=rule: (rule(*x, state, restart)[0] * weights).sum(),
                            argnums=range(5)))(q, k, v, g, beta)
           for rule in (gated_delta_rule, lambda *x: chunked_gated_delta_rule(*x, chunk=chunk))]
  for ours, theirs in zip(*grads):
    np.testing.assert_allclose(ours, theirs, atol=5e-5)


def _cache(layer, rows):
  return lay_out([layer.cache_spec()], {"slots": rows}, stacked=False)[0]


def test_decoding_from_the_state_equals_the_full_pass():
  """Token by token, and in chunks of 3 whose last is padded (only `valid` tokens taken in):
  each output is the full pass's, the state carried between calls."""
  layer = build()
  x = jnp.asarray(RNG.normal(size=(2, 8, 32)), jnp.float32)
  full, _ = run(layer, x)
  state, outs = _cache(layer, 2), []
  for i in range(8):
    out, state = run(layer, x[:, i:i + 1], cache=KVCache(state, jnp.int32(i)))
    outs.append(out)
  np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=1e-5)
  state, outs = _cache(layer, 2), []
  padded = jnp.concatenate([x, jnp.full((2, 1, 32), 7.0)], axis=1)  # 9 = 3 chunks of 3.
  for start in range(0, 9, 3):
    valid = jnp.full((2,), min(3, 8 - start), jnp.int32)
    out, state = run(layer, padded[:, start:start + 3],
                     cache=KVCache(state, jnp.full((2,), start), valid=valid))
    outs.append(out)
  np.testing.assert_allclose(np.concatenate(outs, 1)[:, :8], full, atol=1e-5)
  _, end = run(layer, x[:, :8], cache=KVCache(_cache(layer, 2), jnp.int32(0)))
  for name in ("conv", "recurrent"):  # The padding took nothing in.
    np.testing.assert_allclose(state[name], end[name], atol=1e-5)


def test_a_packed_row_restarts_at_each_segment_and_its_gradient_is_finite():
  layer = build()
  x = jnp.asarray(RNG.normal(size=(1, 10, 32)), jnp.float32)
  segment_ids = jnp.asarray([[1] * 6 + [2] * 4])
  packed, _ = run(layer, x, segment_ids)
  first, _ = run(layer, x[:, :6])
  second, _ = run(layer, x[:, 6:])
  np.testing.assert_allclose(packed, jnp.concatenate([first, second], 1), atol=1e-5)
  grads = nnx.jit(nnx.grad(lambda m: m(x, segment_ids=segment_ids)[0].sum()))(layer)
  leaves = jax.tree.leaves(nnx.state(grads))
  assert all(bool(jnp.isfinite(g).all()) for g in leaves)
  assert float(jnp.abs(grads.A_log[...]).max()) > 0


def test_the_state_a_slot_keeps_does_not_grow_with_the_sequence():
  spec = build().cache_spec()
  assert {name: array.shape for name, array in spec.items()} == {
      "conv": ("slots", 3, SHAPES.conv_dim), "recurrent": ("slots", 4, 8, 6)}
  assert all(array.per_slot for array in spec.values())


def test_value_heads_must_share_key_heads_evenly():
  with pytest.raises(ValueError, match="num_value_heads=5 must be a multiple of num_key_heads=2"):
    LinearAttentionConfig(num_key_heads=2, num_value_heads=5)


def test_a_cache_of_two_replicas_keeps_each_replica_s_slots_apart():
  """Rows 0-1 read and write replica 0's slots, rows 2-3 replica 1's (`layers.per_replica`), as
  the data-parallel engine lays them out; an idle row (slot past the last) writes nothing."""
  layer = build()
  x = jnp.asarray(RNG.normal(size=(4, 3, 32)), jnp.float32)
  state = lay_out([layer.cache_spec()], {"slots": 2}, replicas=2, stacked=False)[0]
  slots = jnp.asarray([1, 2, 0, 1], jnp.int32)  # Row 1 idle.
  out, state = run(layer, x, cache=KVCache(state, jnp.zeros(4, jnp.int32), slots=slots))
  np.testing.assert_allclose(out, run(layer, x)[0], atol=1e-5)  # Every slot started empty.
  for row, (replica, slot) in {0: (0, 1), 2: (1, 0), 3: (1, 1)}.items():
    _, alone = run(layer, x[row:row + 1], cache=KVCache(_cache(layer, 1), jnp.int32(0)))
    np.testing.assert_allclose(state["recurrent"][replica, slot], alone["recurrent"][0],
                               atol=1e-5)
  assert not np.asarray(state["recurrent"][0, 0]).any()  # The idle row's slot past the last.
