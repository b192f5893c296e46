"""What adapting a model needs, owned by the models: inputs to run it once, and the layers
Qwix quantizes.

Quantization and LoRA (`finetune`) ask these of a model config, so `finetune`
imports `models` and never the Tasks that train them (which import `finetune`'s
transforms back). The layers LoRA adapts by default are the config's own
(`configs.DECODER_PROJECTIONS`), readable without jax.

Example:
  >>> from jax_ai_stack.recipes.models.cnn_config import CNNConfig
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> [x.shape for x in example_inputs(DecoderConfig.small())]
  [(1, 128)]
  >>> quant_layers("cnn").other, quant_layers("mixtral").experts, quant_layers("custom")
  ('classifier', True, None)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.models.cnn_config import CNNConfig
from jax_ai_stack.recipes.models.configs import MOE_KINDS, DecoderConfig
from jax_ai_stack.recipes.models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class QuantLayers:
  """Module-path regexes (Qwix matches them in full) of one model's quantized layers
  (what `finetune.quant` builds a scheme's Qwix rules from)."""

  mlp: str
  """The feed-forward weights (int4 in w4)."""
  other: str
  """The other matmul weights that are quantized."""
  convs: str | None = None
  """Convolutions: quantized only with their activations (w8a8)."""
  experts: bool = False
  """A mixture of experts: its experts' stacked weights quantized as `mlp` by the layer itself
  (`models.expert_quant`: not a matmul Qwix intercepts), and `mlp` may match no layer (a MoE
  model without dense or shared MLPs)."""


QUANT_LAYERS: dict[type, QuantLayers] = {
    # The token embedding (also the output head when tied) and an untied lm_head stay
    # float: `jnp.take` cannot read a quantized table.
    DecoderConfig: QuantLayers(mlp=r"layers/\d+/mlp/(gate|up|down)_proj",
                             other=r"layers/\d+/attention/(q|k|v|o)_proj"),
    # Convolutions only in w8a8: Qwix's PTQ convolution needs quantized activations too.
    CNNConfig: QuantLayers(mlp="hidden", other="classifier", convs=r"convs/\d+"),
}
"""Where Qwix quantizes each model config's models; a config not here is not quantized."""


MOE_QUANT_LAYERS = QuantLayers(
    mlp=r"layers/\d+/mlp(/shared_expert)?/(gate|up|down)_proj",
    other=r"layers/\d+/attention/((q|k|v|o|q_a|q_b|kv_a|kv_b)_proj|in_proj_qkvz|in_proj_ba|"
          r"out_proj)",
    experts=True)
"""A mixture of experts' (`MOE_KINDS`): its dense and shared MLPs, its attention (grouped,
latent or linear), and its experts; the router and a shared expert's gate stay float."""

_BY_KIND = {kind: MOE_QUANT_LAYERS if kind in MOE_KINDS else layers
            for config, layers in QUANT_LAYERS.items() for kind in configlib.kinds(config)}


def quant_layers(kind: str) -> QuantLayers | None:
  """Where Qwix quantizes a model of `kind` (`model.kind`); None: nowhere (a model of one's
  own)."""
  return _BY_KIND.get(kind)


def quantized_kinds() -> list[str]:
  """Every `model.kind` that `quant_layers` knows."""
  return list(_BY_KIND)


def example_inputs(model_config: Any, method: str = "__call__") -> tuple:
  """Zeros of the shapes one call of the model's `method` takes.

  What Qwix needs to run a model once (quantization, LoRA adapters); the values
  do not matter. A decoder's are 128 tokens (or its whole context): a TPU's Mosaic attention
  takes sequences in blocks of 128, and a run whose plan is that kernel alone must run them.
  Raises ConfigError for a model that gives none.
  """
  if isinstance(model_config, DecoderConfig):
    tokens = jnp.zeros((1, min(128, model_config.max_seq_len)), jnp.int32)
    if method != "decode":
      return (tokens,)
    # decode also takes a cache: the one its layers lay out (a model without parameters).
    model = nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))
    return tokens, model.init_cache(1, tokens.shape[1])
  if isinstance(model_config, CNNConfig):
    return (jnp.zeros((1, *model_config.image_shape), jnp.float32),)
  raise ConfigError(f"{type(model_config).__name__} models give no example inputs: "
                    "quantization and LoRA do not support this model family")
