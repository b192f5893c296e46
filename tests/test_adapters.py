"""Qwix LoRA adapters on the decoder: where they go, switched off, merged into a plain model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.finetune import adapters
from jax_ai_stack.recipes.finetune.config import LoraConfig
from jax_ai_stack.recipes.models.decoder import Decoder, DecoderConfig

CONFIG = DecoderConfig.tiny(num_layers=1)


def adapted(modules: str = "up_proj", rank: int = 2) -> nnx.Module:
  model = Decoder(CONFIG, rngs=nnx.Rngs(0))
  return adapters.add_adapters(model, LoraConfig(rank=rank, modules=modules), CONFIG, seed=1)


def with_nonzero_b(model: nnx.Module) -> nnx.Module:
  """`model` with every adapter's B factor drawn (it starts at zero)."""
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.LoRAParam) and str(path[-1]).endswith(adapters.B_SUFFIX):
      node.set_value(jnp.full_like(node.get_value(), 0.05))
  return model


def test_adapters_go_on_the_layers_the_regex_names_and_only_there():
  pairs = adapters.adapter_pairs(adapted())
  assert list(pairs) == ["layers/0/mlp/up_proj/kernel"]
  a, b = pairs["layers/0/mlp/up_proj/kernel"]
  assert a.shape == (CONFIG.d_model, 2) and b.shape == (2, CONFIG.mlp_dim)
  assert not np.asarray(b).any()  # B starts at zero: step 0 is the base.


def test_a_regex_that_matches_nothing_and_a_rank_too_wide_are_named():
  with pytest.raises(ConfigError, match="finetune.lora.modules='nothing_here' matches no layer"):
    adapted("nothing_here")
  with pytest.raises(ConfigError, match="finetune.lora.rank=4096 is larger than the width"):
    adapted(rank=4096)


def test_adapters_off_computes_the_base_and_merged_computes_the_adapted_model():
  model = with_nonzero_b(adapted())
  tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % CONFIG.vocab_size
  run = nnx.jit(lambda m, t: m(t))
  base = Decoder(CONFIG, rngs=nnx.Rngs(0))
  off = adapters.adapters_off(model)
  np.testing.assert_array_equal(run(off, tokens), run(base, tokens))
  merged = adapters.merged_model(model, lambda: Decoder(CONFIG, rngs=nnx.Rngs(0)), scale=2.0)
  assert not adapters.adapter_pairs(merged)  # A plain model: no Qwix, no adapters.
  np.testing.assert_allclose(run(merged, tokens), run(model, tokens), atol=1e-5)
  assert np.abs(np.asarray(run(merged, tokens) - run(base, tokens))).max() > 1e-3


def test_with_delta_adds_scaled_a_b_in_float32_and_keeps_the_dtype():
  weight = jnp.ones((3, 2), jnp.bfloat16)
  out = adapters.with_delta(weight, jnp.ones((3, 1)), jnp.full((1, 2), 0.25), scale=2.0)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.full((3, 2), 1.5))
