"""The decoder's gated MLP, dense: a layer's feed-forward, and a mixture of experts' shared
expert (`moe`), with the activations both kinds of MLP take.

Example: a layer of [tokens, D] on [B, T, D] (a dense layer's gradient is one matmul).
  >>> import jax.numpy as jnp
  >>> on_tokens(lambda x: x[:, :2] * 2, jnp.ones((2, 3, 4))).shape
  (2, 3, 2)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack.recipes.models.configs import DecoderConfig

ACTIVATIONS = {"silu": nnx.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
"""The gate's activation of a gated MLP (`DecoderConfig.mlp_activation`), dense or expert."""


def on_tokens(layer: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
  """`layer(x)` applied to x [..., D] as one [tokens, D] matrix, reshaped back.

  The same forward values, but a dense layer's weight gradient becomes one
  plain matmul: on a 3-D input XLA:CPU contracts the batch and sequence axes with
  layout copies around the dot (the tiny Llama's MLP forward+backward took 17 ms
  3-D, 10 ms flattened; the whole step 15-20% less; the gradients sum in another
  order, so their last bits differ). A reshape of the leading axes costs nothing,
  on a mesh too (the batch axis stays the sharded one).
  """
  y = layer(x.reshape(-1, x.shape[-1]))
  return y.reshape(*x.shape[:-1], y.shape[-1])


class MLP(nnx.Module):
  """A gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_tanh."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, hidden: int | None = None):
    """`hidden`: its hidden units (default `config.mlp_dim`; a MoE's shared expert's own)."""
    d, f = config.d_model, hidden or config.mlp_dim
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    init = nnx.initializers.lecun_normal()
    self.gate_proj = nnx.Linear(
        d, f, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
    )
    self.up_proj = nnx.Linear(
        d, f, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
    )
    self.down_proj = nnx.Linear(
        f, d, use_bias=False, rngs=rngs, **dtypes,
        kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
    )
    self.activation = config.mlp_activation

  def __call__(self, x: jax.Array) -> jax.Array:
    act = ACTIVATIONS[self.activation]
    return on_tokens(lambda x: self.down_proj(act(self.gate_proj(x)) * self.up_proj(x)), x)
