"""Llama 4's decoder switches, each against a NumPy reference of its formula, apart from the
family: chunked local attention (training, a decoding step's key lengths, the engine's paged
attention; the kernels without the mask refused by the plan, with the reason), the L2 norm of
q and k after RoPE, the NoPE layers' attention temperature, and top-k sigmoid routing whose
weight scales the expert's input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.kernels import paged
from jax_ai_stack.recipes.models import eager_sharding_scope
from jax_ai_stack.recipes.models.configs import DecoderConfig, MoeConfig
from jax_ai_stack.recipes.models.layers import Attention, l2_norm
from jax_ai_stack.recipes.models.moe import MoE, route
from jax_ai_stack.recipes.models.rope import rope_tables

RNG = np.random.default_rng(0)
B, T, N, K, H, C = 2, 11, 4, 2, 8, 4


def _reference(q, k, v, *, chunk, at=None, lengths=None):
  """float64 NumPy softmax attention where query i (at position at[i], default i) sees the
  keys j <= at[i] with j // chunk == at[i] // chunk (and j < lengths[row])."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, h = q.shape
  s, groups = k.shape[1], n // k.shape[2]
  out = np.zeros_like(q)
  for row in range(b):
    i = (np.arange(t) if at is None else at[row])[:, None]
    j = np.arange(s)[None, :]
    seen = (j <= i) & (j // chunk == i // chunk)
    if lengths is not None:
      seen &= j < lengths[row]
    for head in range(n):
      logits = q[row, :, head] @ k[row, :, head // groups].T / math.sqrt(h)
      logits = np.where(seen, logits, -np.inf)
      weights = np.exp(logits - logits.max(axis=1, keepdims=True))
      out[row, :, head] = (weights / weights.sum(axis=1, keepdims=True)) @ v[row, :, head // groups]
  return out


def _qkv(t=T, s=None):
  q = RNG.normal(size=(B, t, N, H)).astype(np.float32)
  k, v = RNG.normal(size=(2, B, s or t, K, H)).astype(np.float32)
  return q, k, v


def test_chunked_attention_equals_numpy_in_training_and_decoding():
  q, k, v = _qkv()
  out = kernels.attention(*map(jnp.asarray, (q, k, v)), chunk_size=C)
  np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, chunk=C), atol=2e-6, rtol=0)
  # A decoding step: one query per row at position length - 1, keys up to it.
  q1, lengths = q[:, :1], np.array([6, 11], np.int32)
  out = kernels.attention(*map(jnp.asarray, (q1, k, v)), causal=False, chunk_size=C,
                          kv_seq_lengths=jnp.asarray(lengths))
  expected = _reference(q1, k, v, chunk=C, at=(lengths - 1)[:, None], lengths=lengths)
  np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6, rtol=0)


def test_kernels_without_chunks_are_refused_with_the_reason():
  q, k, v = map(jnp.asarray, _qkv())
  with pytest.raises(kernels.NoImplementationError, match=r"chunked attention \(chunk_size\) "
                                                          "not supported"):
    kernels.attention(q, k, v, chunk_size=C, implementation="xla_blocked")
  plan = kernels.resolve_plan("auto", environ={})  # xla_blocked and tokamax: passed over.
  request = kernels.Request.from_shapes(q.shape, k.shape, q.dtype, chunk_size=C)
  assert plan.select(request).name == "xla" and "chunk_size=4" in request.describe()
  assert kernels.Request.from_dict(request.to_dict()) == request
  with pytest.raises(ValueError, match="chunk_size 0 must be an int >= 1"):
    kernels.Request.from_shapes(q.shape, k.shape, q.dtype, chunk_size=0)
  name, why = paged.choose_paged_attention("auto", "tpu", "TPU v5 lite", chunked=True)
  assert name == "xla" and why.startswith("pallas_tpu refused: chunked attention")


def test_paged_attention_with_chunks_equals_numpy():
  """3 queries per row at given positions over pages of 4, chunks of 4 that the queries
  cross: each row's keys of its queries' chunks only."""
  page, width, t = 4, 4, 3
  tables = (1 + RNG.permutation(B * width)).reshape(B, width).astype(np.int32)
  pool = RNG.normal(size=(2, K, 1 + B * width, page, H)).astype(np.float32)
  dense = np.moveaxis(pool[:, :, tables], 1, -2).reshape(2, B, width * page, K, H)
  positions = np.array([[2, 3, 4], [9, 10, 11]], np.int32)
  q = RNG.normal(size=(B, t, N, H)).astype(np.float32)
  out = paged.paged_attention(jnp.asarray(q), jnp.asarray(pool[0]), jnp.asarray(pool[1]),
                              jnp.asarray(tables), jnp.asarray(positions), scale=H ** -0.5,
                              chunk_size=C)
  expected = _reference(q, dense[0], dense[1], chunk=C, at=positions)
  np.testing.assert_allclose(np.asarray(out), expected, atol=2e-6, rtol=0)


def _attention(**switches):
  config = DecoderConfig(kind="llama4", d_model=32, num_heads=N, num_kv_heads=K, head_dim=H,
                         moe=MoeConfig(num_experts=2), **switches)
  with eager_sharding_scope():
    return Attention(config, None, rngs=nnx.Rngs(0), layer=0), config


def test_the_l2_norm_of_q_and_k_after_rope_equals_numpy():
  x = RNG.normal(size=(3, 5, 8)).astype(np.float32) * 4
  expected = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(np.asarray(l2_norm(jnp.asarray(x), 1e-6)), expected, rtol=2e-6)
  attention, _ = _attention(qk_l2_norm=True)
  q, k = map(jnp.asarray, RNG.normal(size=(2, 1, 5, N, H)).astype(np.float32))
  rope = rope_tables(jnp.arange(5)[None], H, 1e4)
  q2, k2 = attention._after_rope(q, k, rope)
  np.testing.assert_allclose(np.asarray(k2), np.asarray(l2_norm(k, 1e-5)), rtol=1e-6)
  nope, _ = _attention(qk_l2_norm=True, nope_layers=(0,))  # NoPE layers keep q and k.
  assert nope._after_rope(q, k, rope)[0] is q


def test_the_nope_layers_temperature_equals_numpy():
  attention, _ = _attention(nope_layers=(0,), nope_temperature=(4.0, 0.5))
  positions = np.array([[0, 3, 4, 11, 100]])
  q = jnp.ones((1, 5, N, H))
  q2, _ = attention._after_rope(q, q, rope_tables(jnp.asarray(positions), H, 1e4))
  expected = 1 + 0.5 * np.log1p(np.floor((positions[0] + 1) / 4.0))  # 1, 1.35, 1.35, 1.55, ...
  np.testing.assert_allclose(np.asarray(q2[0, :, 0, 0]), expected, rtol=1e-6)
  rope_layer, _ = _attention(nope_temperature=(4.0, 0.5))  # Layers with RoPE: no temperature.
  assert rope_layer._after_rope(q, q, rope_tables(jnp.asarray(positions), H, 1e4))[0] is q


def test_sigmoid_top_k_routing_weights_the_expert_s_input():
  """Llama 4's MoE: the top-1 logit's sigmoid scales the token entering its expert, whose
  output is added unweighted (a gated MLP is not linear, so this differs from w * expert(x))."""
  d, f, e = 16, 24, 4
  config = DecoderConfig(kind="llama4", d_model=d, mlp_dim=32, moe=MoeConfig(
      num_experts=e, num_experts_per_tok=1, expert_mlp_dim=f, norm_topk_prob=False,
      router_score="sigmoid", weight_inputs=True, grouped_matmul="xla"))
  with eager_sharding_scope():
    moe = MoE(config, rngs=nnx.Rngs(1))
  x = RNG.normal(size=(2, 5, d)).astype(np.float32)
  y, _ = moe(jnp.asarray(x))
  tokens = x.reshape(-1, d).astype(np.float64)
  logits = tokens @ np.asarray(moe.router.kernel[...], np.float64)
  gate_up = np.concatenate([np.asarray(moe.gate_proj[...], np.float64),
                            np.asarray(moe.up_proj[...], np.float64)], axis=-1)
  down = np.asarray(moe.down_proj[...], np.float64)
  silu = lambda a: a / (1 + np.exp(-a))
  expected = []
  for token, logit in zip(tokens, logits):
    j = int(np.argmax(logit))
    h = (token / (1 + np.exp(-logit[j]))) @ gate_up[j]  # The weight on the input.
    expected.append((silu(h[:f]) * h[f:]) @ down[j])
  np.testing.assert_allclose(np.asarray(y).reshape(-1, d), np.array(expected), atol=2e-5, rtol=0)
  routing = route(jnp.asarray(logits, jnp.float32), 2, False, score="sigmoid")
  top2 = np.sort(logits, axis=1)[:, ::-1][:, :2]
  np.testing.assert_allclose(np.asarray(routing.weights), 1 / (1 + np.exp(-top2)), rtol=1e-5)
