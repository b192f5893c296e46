"""Mixture-of-experts feed-forward layers (Mixtral, Qwen3-MoE), dropless.

A router (a [d_model, E] matrix) scores each token; softmax in float32; the
token goes to its `num_experts_per_tok` (k) best experts (`jax.lax.top_k`: on
a tie the lower index, so a resumed run routes as the original did), their
weights renormalised to sum to 1 when `norm_topk_prob`. Every expert is a
gated MLP, down(act(gate(x)) * up(x)), its weights stacked [E, ...]. The N*k
(token, expert) pairs are sorted by expert (a stable sort) and each of the
three matmuls runs as one grouped matmul over the sorted rows
(`kernels.grouped_matmul`: tokamax's ragged_dot, XLA's, rows padded to blocks
of one batched matmul, or the dense reference); nothing is dropped, whatever the load. The outputs go back to
token order and are summed with the router's weights, in a fixed order (no
scatter-add), so the result does not depend on the device's atomics.

Beside its output a layer reports (`MoeStats`): the Switch load-balancing loss
E * sum_e(f_e * P_e), with f_e the share of the N*k assignments expert e got
and P_e its mean router probability (1 when balanced), the router z-loss
mean(logsumexp(logits)^2), and each expert's share f_e.

Logical axes: "experts" for the expert dimension (replicated unless a rule
maps it), then "embed" and "mlp" as in the dense MLP.

Example:
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig, MoeConfig
  >>> config = DecoderConfig(kind="mixtral", d_model=16, mlp_dim=32,
  ...                        moe=MoeConfig(num_experts=4, grouped_matmul="xla"))
  >>> y, stats = MoE(config, rngs=nnx.Rngs(0))(jnp.ones((2, 3, 16)))
  >>> y.shape, stats.share.shape, float(stats.share.sum())
  ((2, 3, 16), (4,), 1.0)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes.models import eager_sharding_scope
from jax_ai_stack.recipes.models.configs import DecoderConfig

__all__ = ["ACTIVATIONS", "MoE", "MoeStats", "route"]


class MoeStats(NamedTuple):
  """What one MoE layer reports beside its output (scalars, and a share per expert)."""

  balance_loss: jax.Array
  z_loss: jax.Array
  share: jax.Array


class Routing(NamedTuple):
  experts: jax.Array
  """[N, k] the experts each token goes to."""
  weights: jax.Array
  """[N, k] float32, their router weights."""
  sizes: jax.Array
  """[E] int32, how many of the N*k assignments each expert got (the grouped matmul's groups)."""
  stats: MoeStats


def route(logits: jax.Array, k: int, normalize: bool) -> Routing:
  """Top-k routing of router `logits` [N, E] (any float dtype; softmax in float32)."""
  logits = logits.astype(jnp.float32)
  num_experts = logits.shape[-1]
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / weights.sum(axis=-1, keepdims=True)
  sizes = jnp.zeros(num_experts, jnp.int32).at[experts.reshape(-1)].add(1)
  share = sizes.astype(jnp.float32) / experts.size
  balance = num_experts * jnp.sum(share * probs.mean(axis=0))
  z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
  return Routing(experts, weights, sizes, MoeStats(balance, z_loss, share))


ACTIVATIONS = {"silu": nnx.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
"""The gate's activation of a gated MLP (`DecoderConfig.mlp_activation`), dense or expert."""


class MoE(nnx.Module):
  """A dropless mixture of `config.moe.num_experts` gated MLPs (see the module)."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
    with eager_sharding_scope():  # Built alone (tests, notebooks): no mesh needed.
      self._build(config, rngs)

  def _build(self, config: DecoderConfig, rngs: nnx.Rngs) -> None:
    moe = config.moe
    d, f, e = config.d_model, config.expert_mlp_dim, moe.num_experts
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs, **dtypes, kernel_init=(
        nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", None))))
    init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
    param_dtype = jnp.dtype(config.param_dtype)

    def weights(shape, names):
      return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=names)

    self.gate_proj = weights((e, d, f), ("experts", "embed", "mlp"))
    self.up_proj = weights((e, d, f), ("experts", "embed", "mlp"))
    self.down_proj = weights((e, f, d), ("experts", "mlp", "embed"))
    self.k, self.normalize = moe.num_experts_per_tok, moe.norm_topk_prob
    self.activation = config.mlp_activation
    self.dtype = jnp.dtype(config.dtype)
    self.implementation = kernels.choose_grouped_matmul(moe.grouped_matmul)[0]

  def __call__(self, x: jax.Array) -> tuple[jax.Array, MoeStats]:
    tokens = x.reshape(-1, x.shape[-1])
    routing = route(self.router(tokens), self.k, self.normalize)
    flat = routing.experts.reshape(-1)  # [N * k]: token i's picks at i * k ... i * k + k - 1.
    order = jnp.argsort(flat, stable=True)
    rows = tokens[order // self.k].astype(self.dtype)

    def matmul(lhs, weights):
      return kernels.grouped_matmul(lhs, weights[...].astype(self.dtype), routing.sizes,
                                    implementation=self.implementation)

    hidden = ACTIVATIONS[self.activation](matmul(rows, self.gate_proj)) * matmul(rows, self.up_proj)
    out = matmul(hidden, self.down_proj)
    out = out[jnp.argsort(order)].reshape(*routing.experts.shape, -1)  # [N, k, D], token order.
    y = jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), routing.weights).astype(x.dtype)
    return y.reshape(x.shape), routing.stats
