"""One decoder block: its attention (grouped-query, multi-head latent, or a gated DeltaNet's
linear attention) and its MLP (dense, or a mixture of experts), each between its norms and a
residual add.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models import eager_sharding_scope
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> from jax_ai_stack.recipes.models.rope import rope_tables
  >>> with eager_sharding_scope():
  ...   block = Block(DecoderConfig.tiny(), None, rngs=nnx.Rngs(0))
  >>> x, cache, stats = block(jnp.ones((1, 3, 128)), rope_tables(jnp.arange(3)[None], 32, 1e4))
  >>> x.shape, cache, stats
  ((1, 3, 128), None, None)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.latent_attention import LatentAttention
from jax_ai_stack.recipes.models.layers import MLP, Attention, constrain, rms_norm
from jax_ai_stack.recipes.models.linear_attention import GatedDeltaNet
from jax_ai_stack.recipes.models.moe import MoE
from jax_ai_stack.recipes.models.rope import RopeTables

if TYPE_CHECKING:
  from jax_ai_stack.recipes.sharding import Layout


class Block(nnx.Module):
  """One pre-norm decoder block: x + attn(norm(x)), then + mlp(norm(x)).

  The attention is grouped-query (`Attention`), multi-head latent attention
  (`latent_attention.LatentAttention`) with `config.latent_attention`, or in a "linear"
  layer a gated DeltaNet (`linear_attention.GatedDeltaNet`).

  With `post_norms` (Gemma 2/3) each branch's output is normed before its add; without
  `pre_norms` (OLMo 2/3) each branch reads x itself.
  The MLP is a mixture of experts (`moe.MoE`) in the layers `config.moe_layers`
  names; the block then also returns the layer's `moe.MoeStats` (else None).
  """

  def __init__(self, config: DecoderConfig, attention: kernels.AttentionPlan, *, rngs: nnx.Rngs,
               layout: Layout | None = None, layer: int = 0):
    self.attention_norm = rms_norm(config, rngs) if config.pre_norms else None
    sharding = layout.attention() if layout else None
    if config.resolved_layer_types[layer] == "linear":
      self.attention = GatedDeltaNet(config, config.linear_attention, rngs=rngs)
    elif config.latent_attention is not None:
      self.attention = LatentAttention(config, config.latent_attention, attention, rngs=rngs,
                                       sharding=sharding, layer=layer)
    else:
      self.attention = Attention(config, attention, rngs=rngs, layer=layer, sharding=sharding)
    self.mlp_norm = rms_norm(config, rngs) if config.pre_norms else None
    backend = attention.backend if attention else None
    self.mlp = (MoE(config, rngs=rngs, layout=layout, platform=backend and backend.platform,
                    device_kind=backend and backend.device_kind)
                if config.moe_layers[layer] else MLP(config, rngs=rngs))
    if config.post_norms:
      self.post_attention_norm = rms_norm(config, rngs)
      self.post_mlp_norm = rms_norm(config, rngs)
    else:
      self.post_attention_norm = self.post_mlp_norm = None
    self.layout = layout

  def __call__(self, x, rope: RopeTables, segment_ids=None, cache=None):
    h, new_cache = self.attention(_norm(self.attention_norm, x), rope, segment_ids, cache)
    if self.post_attention_norm is not None:
      h = self.post_attention_norm(h)
    x = x + constrain(self.layout, h)
    if isinstance(self.mlp, MoE):
      h, stats = self.mlp(_norm(self.mlp_norm, x), segment_ids)
    else:
      h, stats = self.mlp(_norm(self.mlp_norm, x)), None
    if self.post_mlp_norm is not None:
      h = self.post_mlp_norm(h)
    return x + constrain(self.layout, h), new_cache, stats


def _norm(norm: nnx.Module | None, x: jax.Array) -> jax.Array:
  """`norm(x)`, or x itself where the block has no such norm."""
  return x if norm is None else norm(x)
