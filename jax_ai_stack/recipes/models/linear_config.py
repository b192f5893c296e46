"""The `model.linear_attention` section: the shapes of the gated DeltaNet layers (Qwen3-Next's
"linear_attention" layers), readable without jax (`linear_attention.GatedDeltaNet` builds
them).

Example:
  >>> shapes = LinearAttentionConfig(num_key_heads=16, num_value_heads=32)
  >>> shapes.conv_dim, shapes.state_features
  (8192, 524288)
"""

from __future__ import annotations

from pydantic import PositiveInt

from jax_ai_stack.recipes.configlib import config_dataclass


@config_dataclass
class LinearAttentionConfig:
  """A gated DeltaNet layer: linear attention whose state is a matrix per value head.

  Each token's queries and keys (`num_key_heads` of `key_head_dim`) and values
  (`num_value_heads` of `value_head_dim`) pass a causal depthwise convolution of
  `conv_kernel` taps; each value head's state S [key_head_dim, value_head_dim] then decays
  and takes the token in by the delta rule, S <- a S + b k (v - a S^T k)^T, and is read by
  the query. What a sequence keeps while decoding is that state and the convolution's last
  inputs: a fixed size, whatever its length. The defaults are Qwen3-Next-80B-A3B's.
  """

  num_key_heads: PositiveInt = 16
  """Query and key heads (each serves num_value_heads / num_key_heads value heads)."""
  num_value_heads: PositiveInt = 32
  """Value heads, each with its own state."""
  key_head_dim: PositiveInt = 128
  """Features of a query or key head."""
  value_head_dim: PositiveInt = 128
  """Features of a value head."""
  conv_kernel: PositiveInt = 4
  """Taps of the causal convolution over the queries, keys and values."""

  def __post_init__(self):
    if self.num_value_heads % self.num_key_heads:
      raise ValueError(f"linear_attention.num_value_heads={self.num_value_heads} must be a "
                       f"multiple of num_key_heads={self.num_key_heads}")

  @property
  def conv_dim(self) -> int:
    """Channels of the convolution: the queries', keys' and values' features."""
    return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

  @property
  def state_features(self) -> int:
    """A sequence's recurrent state: num_value_heads x key_head_dim x value_head_dim."""
    return self.num_value_heads * self.key_head_dim * self.value_head_dim
