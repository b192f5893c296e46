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
  positions: jax.Array | None = None
  """[B, T] the positions themselves (what Llama 4's NoPE layers' temperature reads)."""


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """The head_dim / 2 RoPE frequencies 1 / theta^(2i / head_dim), float32.

  With `scaling`, Llama 3.1's rescaling of them, written as transformers'
  `_compute_llama3_parameters` (5.23.0) computes it, in float32; or, "linear",
  all of them divided by the factor. ("longrope" depends on the positions too:
  `rope_tables`.)
  """
  half = head_dim // 2
  inv_freq = 1.0 / theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2 / head_dim)
  if scaling is None:
    return inv_freq
  if scaling.kind == "longrope":
    raise ValueError("longrope's frequencies depend on the positions: use rope_tables")
  if scaling.kind == "linear":  # Gemma 3's global layers: positions / factor.
    return inv_freq / scaling.factor
  if scaling.kind == "yarn":
    return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
  old_context = scaling.original_max_position_embeddings
  low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
  wavelen = 2 * math.pi / inv_freq
  # Long wavelengths are divided by `factor`, short ones kept, those between blended.
  scaled = jnp.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
  return jnp.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: jax.Array, head_dim: int, theta: float,
                   scaling: RopeScaling) -> jax.Array:
  """YaRN's frequencies, as transformers' `_compute_yarn_parameters` (5.24.0): a linear
  ramp over the frequency index between the dimensions that turn beta_fast and beta_slow
  times within the original context blends the kept frequencies (below the ramp) with
  those divided by `factor` (above it)."""
  def dimension(rotations):  # The (fractional) index that turns `rotations` times.
    return (head_dim * math.log(scaling.original_max_position_embeddings
                                / (rotations * 2 * math.pi))) / (2 * math.log(theta))

  low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
  if scaling.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # As transformers: no division by zero.
  ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def attention_factor(scaling: RopeScaling | None) -> float:
  """What YaRN and LongRoPE multiply sin and cos by (`RopeScaling.attention_factor`; by
  default YaRN's 0.1 ln(factor) + 1 (or its `mscale` ratio) and LongRoPE's sqrt(1 + ln(factor) / ln(original
  context)), 1 for factor <= 1); 1 for the other scalings."""
  if scaling is None or scaling.kind not in ("yarn", "longrope"):
    return 1.0
  if scaling.attention_factor is not None:
    return scaling.attention_factor
  if scaling.factor <= 1:
    return 1.0
  if scaling.kind == "yarn":
    if scaling.mscale and scaling.mscale_all_dim:  # DeepSeek-V3's.
      return scaling.yarn_mscale(scaling.mscale) / scaling.yarn_mscale(scaling.mscale_all_dim)
    return scaling.yarn_mscale(1.0)
  return math.sqrt(1 + math.log(scaling.factor)
                   / math.log(scaling.original_max_position_embeddings))


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                scaling: RopeScaling | None = None,
                longest: jax.Array | None = None) -> RopeTables:
  """The RoPE tables of `positions` [B, T] for heads of `head_dim` features.

  LongRoPE ("longrope" `scaling`, Phi-3's) divides the frequencies by its `long_factor`
  in a row whose largest position is original_max_position_embeddings or more, else by
  its `short_factor` (transformers' `_compute_longrope_parameters` and its per-call
  switch, 5.24.0), and multiplies the tables by `attention_factor`. `longest` [B]: each
  row's largest position that holds a token (a padded prompt chunk's last real one);
  None: the largest of `positions`.
  """
  if scaling is not None and scaling.kind == "longrope":
    inv_freq = rope_inv_freq(head_dim, theta)
    short = inv_freq / jnp.asarray(scaling.short_factor, jnp.float32)
    long = inv_freq / jnp.asarray(scaling.long_factor, jnp.float32)
    longest = positions.max(axis=1) if longest is None else longest
    longer = longest + 1 > scaling.original_max_position_embeddings  # [B]
    inv_freq = jnp.where(longer[:, None, None, None], long, short)  # [B,1,1,H/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq
    factor = jnp.float32(attention_factor(scaling))
    return RopeTables(jnp.sin(angles) * factor, jnp.cos(angles) * factor, positions)
  inv_freq = rope_inv_freq(head_dim, theta, scaling)
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B,T,1,H/2]
  factor = attention_factor(scaling)
  if factor == 1.0:
    return RopeTables(jnp.sin(angles), jnp.cos(angles), positions)
  return RopeTables(jnp.sin(angles) * factor, jnp.cos(angles) * factor, positions)


def rotate(x: jax.Array, rope: RopeTables) -> jax.Array:
  """Rotates feature pairs (i, i + H/2) of `x` [B, T, N, H] by the `rope` angles.

  Tables of R/2 < H/2 angles (`DecoderConfig.rotary_dim` R, Phi-3's partial rotation)
  turn the pairs (i, i + R/2) of the first R features; the other H - R pass as they are.
  The rotation runs in float32 whatever the dtype of `x`, so bfloat16 runs see
  the same rotation as float32 ones; the result has the dtype of `x`.
  """
  sin, cos = rope.sin, rope.cos
  rotary = 2 * sin.shape[-1]
  if rotary < x.shape[-1]:
    return jnp.concatenate([rotate(x[..., :rotary], rope), x[..., rotary:]], axis=-1)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates feature pairs (i, i + H/2) of `x` [B, T, N, H] by position [B, T]."""
  return rotate(x, rope_tables(positions, x.shape[-1], theta))
