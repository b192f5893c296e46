"""Flax NNX models of the recipes: `decoder` (the decoder LM of every family) and `cnn`.

The model classes and configs are re-exported here and load on first use, e.g.
`models.Decoder(models.DecoderConfig.tiny(), rngs=nnx.Rngs(0))`. The configs live
in `configs`, which imports no jax; `layers` holds the decoder's layers, `block` a block
of them, `cache` what a layer caches for decoding (its spec, laid out for the engine),
`rope` the rotary embeddings, `decoding` sampling with the KV cache (`generate`), `moe` the
mixture-of-experts feed-forward layers (Mixtral, Qwen3-MoE; `expert_quant` their experts
quantized), `latent_attention` DeepSeek's multi-head latent attention (its shapes in
`latent_config`), `linear_attention` Qwen3-Next's gated DeltaNet (its shapes in
`linear_config`), `param_count` a config's parameters and FLOPs, `activation_memory` what a
decoder keeps for the backward pass; `hf` reads and writes Hugging Face
directories (config.json + safetensors); `layer_stack` converts a decoder between
the unrolled and the scanned (`scan_layers`) layouts. `Llama` and `LlamaConfig`, the
decoder's first names, still import (here and from `llama`) with a DeprecationWarning.

Example:
  >>> from jax_ai_stack.recipes import models
  >>> config = models.DecoderConfig.tiny()
  >>> config.num_layers, models.Decoder.__module__
  (4, 'jax_ai_stack.recipes.models.decoder')
"""

from __future__ import annotations

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("decoder", "activation_memory", "adapting", "block", "cache", "cnn", "cnn_config",
               "configs", "custom_config", "decoding", "expert_quant", "head", "hf",
               "latent_attention", "latent_config", "layer_stack", "layers", "linear_attention",
               "linear_config", "llama", "mlp", "moe", "moe_config", "param_count", "rope",
               "rope_config")
_EXPORTS = {
    "Decoder": "decoder",
    "DecoderConfig": "configs",
    "RopeScaling": "configs",
    "MoeConfig": "configs",
    "KVCache": "decoder",
    "generate": "decoding",
    "apply_rope": "rope",
    "CNN": "cnn",
    "CNNConfig": "cnn_config",
    "CustomModelConfig": "configs",
}
__all__ = ["eager_sharding_scope", *_SUBMODULES, *_EXPORTS]


def eager_sharding_scope():
  """A context in which new parameters are sharded at creation only under a mesh.

  Every parameter carries logical axis names (`nnx.with_partitioning`). Flax
  0.12 shards such a parameter the moment it is created ("eager sharding", on
  by default) and raises when no mesh is active. Outside a mesh (one CPU, tests,
  `nnx.eval_shape`) the names stay as metadata only, for the sharding recipe to
  map onto mesh axes; under a mesh the library's eager sharding is left as set.
  """
  import jax
  from flax import nnx

  mesh_active = not jax.sharding.get_abstract_mesh().empty
  return nnx.use_eager_sharding(nnx.using_eager_sharding() and mesh_active)


__getattr__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS, renamed={
    "Llama": f"{__name__}.Decoder", "LlamaConfig": f"{__name__}.DecoderConfig"})[0]


def __dir__():  # Also eager_sharding_scope, which is no lazy attribute.
  return sorted(__all__)
