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

A shared expert (`MoeConfig.shared_expert_dim`: Qwen2-MoE; DeepSeek-V3, Llama 4 and
Qwen3-Next have one too) is a dense gated MLP every token runs, its output added to the
routed experts' sum; with `shared_expert_gate`, scaled by sigmoid(x . w) first. It is an
ordinary dense layer (`mlp.MLP`, under `shared_expert`), sharded as the dense MLPs are.

GPT-OSS's experts (`MoeConfig`'s `router_bias`, `expert_bias`, `interleaved_gate_up`,
`expert_activation="clamped_swiglu"`): a bias on the router's logits; one `gate_up_proj`
[E, d, 2f] whose even columns are the gate and odd the up, with biases on it
(`gate_up_proj_bias` [E, 2f], added to each row by its expert) and on `down_proj`
(`down_proj_bias` [E, d], added once per (token, expert) pair with the router's weight,
outside the grouped matmul, so that a split `mlp` axis does not add it once per device);
and the clamped SwiGLU.

Llama 4's router (`router_score` "sigmoid", `weight_inputs`): the top-k logits, each
expert's weight the sigmoid of its own, scaling the rows that enter the expert (the sorted
tokens) rather than its output, which is then summed unweighted.

DeepSeek-V3's router (`router_score` "sigmoid", `score_correction`, `router_groups`,
`routed_scale`): the experts are chosen by their sigmoid scores plus a per-expert bias
(`correction_bias`, which moves the choice only), among the experts of each token's best
groups, and weighted by their uncorrected scores, renormalised, times a constant. Its shared
experts are one ungated shared expert as wide as all of them. Training moves the bias toward
balance where `correction_update` asks: a sign step against each expert's load above its share
(`balancing_pull` gives it as the bias's gradient; `optim` steps it).

Quantized (`finetune.quant`: PTQ, a QLoRA base, QAT), the experts' stacked weights are
Qwix's int8/int4 arrays dequantized before the grouped matmul, or rounded to that grid in
training (`expert_quant`); the router stays float.

Beside its output a layer reports (`MoeStats`): the Switch load-balancing loss
E * sum_e(f_e * P_e), with f_e the share of the N*k assignments expert e got
and P_e its mean router probability (1 when balanced), the router z-loss
mean(logsumexp(logits)^2), and each expert's share f_e.

Logical axes: "experts" for the expert dimension, then "embed" and "mlp" as in
the dense MLP. On a mesh (given a layout) the layer runs inside `jax.shard_map`,
each device sorting its own tokens: left to XLA, the sort by expert spans every
device's tokens, which XLA replicates for it. Where the layout maps "experts"
onto mesh axes (`mesh.expert`), the layer runs expert-parallel: each device
gathers the tokens of the devices that share its other coordinates (an
all-gather over the expert axes, Megatron's "allgather" dispatcher), runs its
own experts on the tokens routed to them, and the weighted outputs go back to
their tokens' devices summed (a reduce-scatter).
Each expert's weights stay on their device whole along "embed" (gathered over
`fsdp`, like every weight under fsdp) and split along "mlp" over `tensor`
(partial sums, added in the same reduction). The buffer is dropless: its rows
are every gathered (token, expert) pair, so one device could take them all.

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

import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.recipes.models import eager_sharding_scope, expert_quant
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.mlp import ACTIVATIONS, MLP

if TYPE_CHECKING:
  from jax_ai_stack.recipes.sharding import Layout

__all__ = ["ACTIVATIONS", "MoE", "MoeStats", "route"]


class MoeStats(NamedTuple):
  """What one MoE layer reports beside its output (scalars, and a share per expert)."""

  balance_loss: jax.Array
  z_loss: jax.Array
  share: jax.Array
  balancing: jax.Array | float = 0.0
  """Zero; its gradient is the choice bias's pull toward balance (`balancing_pull`), which
  a training loss adds it for (`decoder.moe_losses`)."""


class Routing(NamedTuple):
  experts: jax.Array
  """[N, k] the experts each token goes to."""
  weights: jax.Array
  """[N, k] float32, their router weights."""
  sizes: jax.Array
  """[E] int32, how many of the N*k assignments each expert got (the grouped matmul's groups)."""
  stats: MoeStats


def route(logits: jax.Array, k: int, normalize: bool, counted: jax.Array | None = None,
          score: str = "softmax", *, correction: jax.Array | None = None, groups: int = 1,
          topk_groups: int = 1, scale: float = 1.0, pull: bool = False) -> Routing:
  """Top-k routing of router `logits` [N, E] (any float dtype; softmax in float32).

  `score` "sigmoid" (Llama 4's, DeepSeek-V3's): the k largest sigmoids of the logits, each
  weighted by its own (the statistics still use the softmax's probabilities); `correction`
  [E] is added to them for the choice only, and with `groups` > 1 only the experts of the
  `topk_groups` groups whose two best scores sum highest are chosen (`MoeConfig`).
  `scale` multiplies the weights last (`MoeConfig.routed_scale`). `pull`: the stats'
  `balancing` gives `correction` the gradient share - 1/E (`balancing_pull`).
  `counted` [N] (bool): the tokens the statistics and losses are over (None: all).
  Padding is routed and computed like any token, but it would pull the balance
  loss towards whichever experts padding prefers, so the caller leaves it out.
  """
  logits = logits.astype(jnp.float32)
  num_experts = logits.shape[-1]
  probs = jax.nn.softmax(logits, axis=-1)
  if score == "sigmoid":
    scores = jax.nn.sigmoid(logits)
    if correction is None and groups == 1:  # The order of the sigmoids is the logits'.
      _, experts = jax.lax.top_k(logits, k)
    else:
      choice = scores if correction is None else scores + correction.astype(jnp.float32)
      _, experts = jax.lax.top_k(_within_best_groups(choice, groups, topk_groups), k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
  else:
    weights, experts = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / weights.sum(axis=-1, keepdims=True)
  if scale != 1.0:
    weights = weights * scale
  sizes = jnp.zeros(num_experts, jnp.int32).at[experts.reshape(-1)].add(1)
  z = jax.nn.logsumexp(logits, axis=-1) ** 2
  if counted is None:
    share, mean_probs, z_loss = sizes.astype(jnp.float32) / experts.size, probs.mean(0), z.mean()
  else:
    weight = counted.astype(jnp.float32)
    tokens = jnp.maximum(weight.sum(), 1.0)
    picks = jnp.zeros(num_experts, jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(weight, k))
    share, mean_probs = picks / (tokens * k), (probs * weight[:, None]).sum(0) / tokens
    z_loss = (z * weight).sum() / tokens
  balance = num_experts * jnp.sum(share * mean_probs)
  balancing = balancing_pull(correction, share) if pull and correction is not None else 0.0
  return Routing(experts, weights, sizes, MoeStats(balance, z_loss, share, balancing))


@jax.custom_vjp
def balancing_pull(correction: jax.Array, share: jax.Array) -> jax.Array:
  """Zero, whose gradient for `correction` [E] is `share` [E] (each expert's part of the
  assignments) less its mean 1/E: added to the loss, the choice bias's gradient says which
  experts took too much, and a sign descent of it (`optim`, `MoeConfig.correction_update`)
  is DeepSeek-V3's bias update, riding the gradients' accumulation, averaging over devices
  and checkpoints."""
  del correction, share
  return jnp.zeros((), jnp.float32)


def _pull_forward(correction, share):
  return balancing_pull(correction, share), (share, correction)


def _pull_backward(residuals, cotangent):
  share, correction = residuals
  return ((share - share.mean()) * cotangent).astype(correction.dtype), jnp.zeros_like(share)


balancing_pull.defvjp(_pull_forward, _pull_backward)


def _within_best_groups(choice: jax.Array, groups: int, keep: int) -> jax.Array:
  """`choice` [N, E] with the experts outside each token's `keep` best of `groups` equal groups
  at -inf; a group's score is the sum of its two best (DeepSeek-V3's group-limited routing)."""
  if groups == 1 or keep == groups:
    return choice
  tokens, experts = choice.shape
  grouped = choice.reshape(tokens, groups, experts // groups)
  _, best = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), keep)
  chosen = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
  return jnp.where(chosen[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)


class MoE(nnx.Module):
  """A dropless mixture of `config.moe.num_experts` gated MLPs (see the module)."""

  def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, layout: Layout | None = None,
               platform: str | None = None, device_kind: str | None = None):
    """`platform` and `device_kind`: the devices the grouped matmul is chosen for (those the
    model is compiled for, as its attention plan's backend says: a v4 takes no Mosaic
    kernel); None: JAX's default backend."""
    with eager_sharding_scope():  # Built alone (tests, notebooks): no mesh needed.
      self._build(config, rngs, platform, device_kind)
    self.layout = layout

  def _build(self, config: DecoderConfig, rngs: nnx.Rngs, platform: str | None,
             device_kind: str | None) -> None:
    moe = config.moe
    d, f, e = config.d_model, config.expert_mlp_dim, moe.num_experts
    dtypes = dict(dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype))
    self.router = nnx.Linear(d, e, use_bias=moe.router_bias, rngs=rngs, **dtypes, kernel_init=(
        nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", None))),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros, (None,)))
    # DeepSeek-V3's choice-only bias: a float32 Param whose gradient is zero (see MoeConfig).
    self.correction_bias = nnx.Param(jnp.zeros((e,), jnp.float32), out_sharding=(None,)) \
        if moe.score_correction else None
    self.groups = (moe.router_groups, moe.router_topk_groups)
    self.routed_scale = moe.routed_scale
    self.pull = moe.correction_update > 0
    init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
    param_dtype = jnp.dtype(config.param_dtype)

    def weights(shape, names):
      return nnx.Param(init(rngs.params(), shape, param_dtype), out_sharding=names)

    self.in_names = ("gate_up_proj",) if moe.interleaved_gate_up else ("gate_proj", "up_proj")
    width = 2 * f if moe.interleaved_gate_up else f
    self.score, self.weight_inputs = moe.router_score, moe.weight_inputs
    for name in self.in_names:
      setattr(self, name, weights((e, d, width), ("experts", "embed", "mlp")))
    self.down_proj = weights((e, f, d), ("experts", "mlp", "embed"))
    self.bias_names = ()
    if moe.expert_bias:
      self.bias_names = (*(name + "_bias" for name in self.in_names), "down_proj_bias")
      for name in self.in_names:
        setattr(self, name + "_bias", nnx.Param(jnp.zeros((e, width), param_dtype),
                                                out_sharding=("experts", "mlp")))
      self.down_proj_bias = nnx.Param(jnp.zeros((e, d), param_dtype),
                                      out_sharding=("experts", "embed"))
    self.expert_activation = moe.expert_activation
    self.swiglu = (moe.swiglu_alpha, moe.swiglu_limit)
    if moe.shared_expert_dim is not None:

      self.shared_expert = MLP(config, rngs=rngs, hidden=moe.shared_expert_dim)
    else:
      self.shared_expert = None
    self.shared_expert_gate = nnx.Linear(
        d, 1, use_bias=False, rngs=rngs, **dtypes, kernel_init=nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("embed", None))) if moe.shared_expert_gate else None
    self.k, self.normalize = moe.num_experts_per_tok, moe.norm_topk_prob
    self.activation = config.mlp_activation
    self.dtype = jnp.dtype(config.dtype)
    self.implementation = kernels.choose_grouped_matmul(moe.grouped_matmul, platform,
                                                        device_kind)[0]
    self.fake_quant = None
    """QAT's weight type for the experts (`expert_quant.fake_quantize`), set by `finetune.quant`;
    None: float. (PTQ replaces the weights themselves: `expert_quant.quantize`.)"""

  def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None
               ) -> tuple[jax.Array, MoeStats]:
    """`x` [B, T, D] -> (the layer's output, its router's stats); `segment_ids` [B, T]:
    the statistics leave out padding (segment id 0)."""
    tokens = x.reshape(-1, x.shape[-1])
    counted = None if segment_ids is None else segment_ids.reshape(-1) != 0
    correction = None if self.correction_bias is None else self.correction_bias[...]
    routing = route(self.router(tokens), self.k, self.normalize, counted, self.score,
                    correction=correction, groups=self.groups[0], topk_groups=self.groups[1],
                    scale=self.routed_scale, pull=self.pull)
    params = {name: expert_quant.stored(getattr(self, name), self.dtype, self.fake_quant)
              for name in (*self.in_names, "down_proj")}
    params.update({name: getattr(self, name)[...].astype(self.dtype) for name in self.bias_names})
    down_bias = params.pop("down_proj_bias", None)
    if self.layout is not None:
      y = self._on_mesh(x, routing, params)
    else:
      y = self._experts(tokens, routing.experts, routing.weights, routing.sizes, params)
    y = y.reshape(x.shape)
    if down_bias is not None:  # Each pair's bias, weighted: once, whatever the mesh. A
      # matmul with each token's weight per expert, not a gather of the [E, D] table, which
      # GSPMD replicates when its D is split (fsdp) and the tokens are not.
      per_expert = jnp.einsum("nk,nke->ne", routing.weights,
                              jax.nn.one_hot(routing.experts, down_bias.shape[0]))
      y = y + (per_expert @ down_bias.astype(jnp.float32)).reshape(x.shape)
    y = y.astype(x.dtype)
    if self.shared_expert is not None:
      shared = self.shared_expert(x)
      if self.shared_expert_gate is not None:
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
      y = y + shared
    return y, routing.stats

  def _activate(self, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The experts' hidden units from their gate and up projections."""
    if self.expert_activation == "clamped_swiglu":
      alpha, limit = self.swiglu
      gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
      return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)
    return ACTIVATIONS[self.activation](gate) * up

  def _experts(self, tokens: jax.Array, experts: jax.Array, weights: jax.Array,
               sizes: jax.Array, params: dict[str, jax.Array],
               first: jax.Array | int = 0) -> jax.Array:
    """[N, D] float32: each token's weighted sum over its experts among `params`' (the
    input projections of `in_names` and their biases, and down_proj, stacked [E_local, ...]:
    experts `first` ... `first + E_local - 1`, whose assignment counts are `sizes`); experts
    elsewhere add nothing."""
    down = params["down_proj"]
    local = down.shape[0]
    flat = experts.reshape(-1)  # [N * k]: token i's picks at i * k ... i * k + k - 1.
    order = jnp.argsort(flat, stable=True)
    if not isinstance(first, int) or first != 0:  # Expert parallelism: its rows first.
      order = jnp.roll(order, -jnp.sum(flat < first))
    rows = tokens[order // self.k]
    if self.weight_inputs:  # Llama 4's: each expert's input scaled by its weight.
      rows = rows.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
      weights = jnp.ones_like(weights)
    rows = rows.astype(self.dtype)

    def matmul(lhs, stacked):
      return kernels.grouped_matmul(lhs, stacked, sizes, implementation=self.implementation)

    row_expert = flat[order] - first  # Rows past these experts' groups: outside 0 .. local.
    mine = (row_expert >= 0) & (row_expert < local)

    def project(name):
      y = matmul(rows, params[name])
      if name + "_bias" in params:
        bias = params[name + "_bias"][jnp.clip(row_expert, 0, local - 1)]
        y = y + jnp.where(mine[:, None], bias, 0).astype(y.dtype)
      return y

    if len(self.in_names) == 1:  # Interleaved: gate in the even columns, up in the odd.
      gate_up = project(self.in_names[0])
      gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    else:
      gate, up = (project(name) for name in self.in_names)
    hidden = self._activate(gate, up)
    out = matmul(hidden, down)  # Rows past these experts' groups: zeros.
    out = out[jnp.argsort(order)].reshape(*experts.shape, -1)  # [N, k, D], token order.
    return jnp.einsum("nkd,nk->nd", out.astype(jnp.float32), weights)

  def _on_mesh(self, x: jax.Array, routing: Routing, params: dict[str, jax.Array]
               ) -> jax.Array:
    """The layer's output on the layout's mesh, with the experts split over its expert
    axes if any (see the module): one `jax.shard_map` over the whole mesh. Without
    expert axes each device runs every expert on its own tokens."""
    layout, (batch, length, _) = self.layout, x.shape
    rules = dict(layout.rules)
    expert_axes = tuple(rules.get("experts", ()))
    token_spec = layout.spec(("batch", None, None), x.shape)
    token_axes = _axes(token_spec[0])
    mlp_axes = tuple(a for a in rules.get("mlp", ())
                     if a not in (*rules.get("batch", ()), *expert_axes))
    gather = tuple(a for a in token_axes if a in expert_axes)
    reduce = tuple(a for a in expert_axes if a not in gather) + mlp_axes
    local_experts = params["down_proj"].shape[0] // math.prod(
        layout.mesh.shape[a] for a in expert_axes)
    k = self.k

    def shard(x, experts, weights, params):
      tokens, experts, weights = (a.reshape(-1, a.shape[-1]) for a in (x, experts, weights))
      if gather:
        tokens, experts, weights = (jax.lax.all_gather(a, gather, axis=0, tiled=True)
                                    for a in (tokens, experts, weights))
      first = jax.lax.axis_index(expert_axes) * local_experts if expert_axes else 0
      mine = experts.reshape(-1) - first
      sizes = jnp.zeros(local_experts, jnp.int32).at[
          jnp.where((mine >= 0) & (mine < local_experts), mine, local_experts)].add(1, mode="drop")
      y = self._experts(tokens, experts, weights, sizes, params, first)
      if reduce:
        y = jax.lax.psum(y, reduce)
      if gather:
        y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
      return y.reshape(x.shape)

    spec = jax.sharding.PartitionSpec
    per_token = spec(token_spec[0], None, None)
    experts_, mlp_ = expert_axes or None, mlp_axes or None
    specs = {name: spec(experts_, mlp_) if name.endswith("_bias") else
             spec(experts_, mlp_, None) if name == "down_proj" else spec(experts_, None, mlp_)
             for name in params}
    # check_vma=False: the grouped matmul may be an opaque kernel (tokamax's custom VJP).
    return jax.shard_map(
        shard, mesh=layout.mesh, check_vma=False,
        in_specs=(per_token, per_token, per_token, specs),
        out_specs=per_token,
    )(x, routing.experts.reshape(batch, length, k), routing.weights.reshape(batch, length, k),
      params)


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry (None, an axis or a tuple of axes) as a tuple of axes."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
