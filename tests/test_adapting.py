"""What adapting a model needs, from the model's own config: example inputs, quantized layers."""

from __future__ import annotations

import pytest

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.models import adapting
from jax_ai_stack.recipes.models.cnn_config import CNNConfig
from jax_ai_stack.recipes.models.configs import MOE_KINDS, CustomModelConfig, DecoderConfig
from jax_ai_stack.recipes.models.decoder import KVCache


def test_every_decoder_kind_is_quantized_a_mixture_of_experts_with_its_experts():
  kinds = adapting.quantized_kinds()
  assert {"llama", "qwen3", "gemma3", "cnn", *MOE_KINDS} <= set(kinds)
  assert all(adapting.quant_layers(k) == adapting.QUANT_LAYERS[DecoderConfig]
             for k in kinds if k != "cnn" and k not in MOE_KINDS)
  assert all(adapting.quant_layers(k).experts for k in MOE_KINDS)
  assert not adapting.quant_layers("llama").experts and adapting.quant_layers("custom") is None


def test_example_inputs_fit_each_method_and_a_model_of_one_s_own_has_none():
  config = DecoderConfig.small()
  tokens, cache = adapting.example_inputs(config, "decode")
  assert isinstance(cache, KVCache) and len(cache.state) == config.num_layers
  assert cache.state[0]["keys"].shape == (1, tokens.shape[1], config.num_kv_heads,
                                          config.resolved_head_dim)
  (images,) = adapting.example_inputs(CNNConfig())
  assert images.shape == (1, *CNNConfig().image_shape)
  with pytest.raises(ConfigError, match="CustomModelConfig models give no example inputs"):
    adapting.example_inputs(CustomModelConfig())
