"""The `model.latent_attention` section: multi-head latent attention's shapes (DeepSeek-V2/V3,
Kimi-K2), readable without jax (`latent_attention.LatentAttention` builds the layer).

Example:
  >>> shapes = LatentAttentionConfig(kv_lora_rank=512, qk_rope_head_dim=64)
  >>> shapes.qk_head_dim, shapes.cached_features
  (192, 576)
"""

from __future__ import annotations

from pydantic import PositiveInt

from jax_ai_stack.recipes.configlib import config_dataclass


@config_dataclass
class LatentAttentionConfig:
  """Multi-head latent attention: keys and values made from one low-rank latent per token.

  Each token's `kv_lora_rank` latent (RMS-normed) and one `qk_rope_head_dim` key shared by
  every head (turned by RoPE) are all a layer caches: `cached_features` a token, where
  grouped-query attention caches 2 x kv_heads x head_dim. Each head's keys and values are
  the latent projected up (`qk_nope_head_dim` and `v_head_dim` features), its queries
  `qk_nope_head_dim` + `qk_rope_head_dim` features, made through a `q_lora_rank` latent of
  their own where it is set. The defaults are DeepSeek-V3's.
  """

  kv_lora_rank: PositiveInt = 512
  """Features of the latent that keys and values are projected up from."""
  q_lora_rank: PositiveInt | None = 1536
  """Features of the queries' latent; None: queries projected straight from the stream."""
  qk_nope_head_dim: PositiveInt = 128
  """Each head's query and key features that RoPE does not turn."""
  qk_rope_head_dim: PositiveInt = 64
  """Each head's query features RoPE turns, and the key every head shares (even)."""
  v_head_dim: PositiveInt = 128
  """Each head's value features."""

  def __post_init__(self):
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")

  @property
  def qk_head_dim(self) -> int:
    """A head's query and key features: `qk_nope_head_dim` + `qk_rope_head_dim`."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def cached_features(self) -> int:
    """What a layer caches a token: the latent and the shared RoPE key."""
    return self.kv_lora_rank + self.qk_rope_head_dim
