"""Rotary position embeddings (RoPE) of the Llama models, with Llama 3.1's frequency scaling.

Written here once (flax 0.12.8 has no `nnx.RoPE`), with the same "rotate half"
convention as `nnx.RoPE` of later versions: feature pairs (i, i + H/2) are
rotated by position x 1 / theta^(2i / H). The tables are computed once per
forward pass and shared by every layer.

Example:
  >>> x = jnp.ones((1, 2, 1, 4))  # [B, T, N, H]
  >>> y = apply_rope(x, jnp.array([[0, 1]]), 10_000.0)[0, :, 0]  # Position 0 is kept.
  >>> [[round(float(v), 3) for v in row] for row in y]
  [[1.0, 1.0, 1.0, 1.0], [-0.301, 0.99, 1.382, 1.01]]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ai_stack.recipes.models.configs import RopeScaling


class RopeTables(NamedTuple):
  """sin and cos of every position's RoPE angles, float32 [B, T, 1, head_dim / 2].

  Computed once per forward pass and shared by every layer: the angles depend
  only on the positions. (Unrolled, XLA merges the layers' copies anyway; a
  scanned stack would compute them again in every iteration of its loop.)
  """

  sin: jax.Array
  cos: jax.Array


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """The head_dim / 2 RoPE frequencies 1 / theta^(2i / head_dim), float32.

  With `scaling`, Llama 3.1's rescaling of them, written as transformers'
  `_compute_llama3_parameters` (5.23.0) computes it, in float32; or, "linear",
  all of them divided by the factor.
  """
  half = head_dim // 2
  inv_freq = 1.0 / theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2 / head_dim)
  if scaling is None:
    return inv_freq
  if scaling.kind == "linear":  # Gemma 3's global layers: positions / factor.
    return inv_freq / scaling.factor
  old_context = scaling.original_max_position_embeddings
  low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are divided by `factor`, short ones kept, those between blended.
  scaled = jnp.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
  return jnp.where(medium, smoothed, scaled)


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> RopeTables:
  """The RoPE tables of `positions` [B, T] for heads of `head_dim` features."""
  inv_freq = rope_inv_freq(head_dim, theta, scaling)
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B,T,1,H/2]
  return RopeTables(jnp.sin(angles), jnp.cos(angles))


def rotate(x: jax.Array, rope: RopeTables) -> jax.Array:
  """Rotates feature pairs (i, i + H/2) of `x` [B, T, N, H] by the `rope` angles.

  The rotation runs in float32 whatever the dtype of `x`, so bfloat16 runs see
  the same rotation as float32 ones; the result has the dtype of `x`.
  """
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  sin, cos = rope
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates feature pairs (i, i + H/2) of `x` [B, T, N, H] by position [B, T]."""
  return rotate(x, rope_tables(positions, x.shape[-1], theta))
