"""A MoE layer's experts quantized with Qwix: stored (PTQ, QLoRA) and faked (QAT)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

from jax_ai_stack.recipes.models import expert_quant
from jax_ai_stack.recipes.models.configs import DecoderConfig, MoeConfig
from jax_ai_stack.recipes.models.moe import MoE


def _layer(**moe) -> MoE:
  config = DecoderConfig(kind="mixtral", d_model=64, mlp_dim=128,
                         moe=MoeConfig(num_experts=4, grouped_matmul="xla", **moe))
  return MoE(config, rngs=nnx.Rngs(0))


X = jax.random.normal(jax.random.key(1), (2, 8, 64))


@pytest.mark.parametrize("qtype, levels", [(jnp.int8, 127), (jnp.int4, 7)])
def test_a_weight_has_a_scale_per_expert_and_output_channel(qtype, levels):
  w = jax.random.normal(jax.random.key(0), (3, 16, 8))
  q = expert_quant.quantize_array(w, qtype)
  assert q.qvalue.dtype == qtype and q.scale.shape == (3, 1, 8)
  error = np.abs(np.asarray(qwix.dequantize(q)) - np.asarray(w))
  step = np.abs(np.asarray(w)).max(axis=1, keepdims=True) / levels  # Each column's grid.
  assert (error <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("moe", [{}, {"interleaved_gate_up": True, "expert_bias": True,
                                      "expert_activation": "clamped_swiglu"}])
def test_stored_experts_compute_what_their_dequantized_float_weights_do(moe):
  layer = _layer(**moe)
  names = (*layer.in_names, "down_proj")
  quantized = nnx.clone(layer)
  expert_quant.quantize(quantized, names, jnp.int8)
  assert all(expert_quant.is_quantized(getattr(quantized, n)) for n in names)
  for name in names:  # The float layer given the rounded weights.
    stored = getattr(quantized, name)
    getattr(layer, name)[...] = expert_quant.stored(stored, jnp.float32)
  np.testing.assert_array_equal(np.asarray(quantized(X)[0]), np.asarray(layer(X)[0]))
  expert_quant.quantize(quantized, names, jnp.int4)  # Already quantized: kept as it is.
  assert getattr(quantized, names[0]).array.qtype == jnp.int8


def test_qat_rounds_the_experts_as_ptq_stores_them_and_passes_gradients_straight_through():
  layer = _layer()
  stored = nnx.clone(layer)
  expert_quant.quantize(stored, (*stored.in_names, "down_proj"), jnp.int8)
  layer.fake_quant = jnp.int8
  np.testing.assert_array_equal(np.asarray(layer(X)[0]), np.asarray(stored(X)[0]))

  w = jax.random.normal(jax.random.key(2), (2, 4, 3))
  grad = jax.grad(lambda w: (expert_quant.fake_quantize(w, jnp.int4) * 3.0).sum())(w)
  np.testing.assert_array_equal(np.asarray(grad), np.full(w.shape, 3.0))
