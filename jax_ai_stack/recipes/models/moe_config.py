"""The `model.moe` section: a decoder's mixture-of-experts feed-forward layers, readable
without jax (`configs.DecoderConfig.moe`; `moe.MoE` builds them).

Example:
  >>> MoeConfig(num_experts=4, shared_expert_dim=32).num_experts_per_tok
  2
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from jax_ai_stack.recipes.configlib import config_dataclass

GroupedMatmul = Literal["auto", "tokamax", "xla", "blocked", "dense"]


@config_dataclass
class MoeConfig:
  """Mixture-of-experts feed-forward layers (`model.moe`; Mixtral, Qwen3-MoE, Qwen2-MoE,
  GPT-OSS, Llama 4, DeepSeek-V3).

  A router scores each token against every expert (softmax in float32) and its
  `num_experts_per_tok` best experts (ties: the lower index) each run their own
  gated MLP on it; their outputs are summed, weighted by the router.
  """

  num_experts: Annotated[int, pydantic.Field(ge=2)] = 8
  """Experts per MoE layer."""
  num_experts_per_tok: PositiveInt = 2
  """Experts each token is sent to (top-k)."""
  expert_mlp_dim: PositiveInt | None = None
  """Hidden units of each expert's gated MLP (Qwen3-MoE's moe_intermediate_size);
  None: `mlp_dim` (Mixtral's intermediate_size)."""
  norm_topk_prob: bool = True
  """Renormalise the chosen experts' router weights to sum to 1 (Mixtral always;
  Qwen3-MoE as its config says)."""
  router_aux_loss_coef: Annotated[float, pydantic.Field(ge=0.0)] = 0.01
  """Weight of the Switch load-balancing loss, E * sum_e(tokens share_e * mean prob_e),
  1 when balanced, added to the training loss."""
  router_z_loss_coef: Annotated[float, pydantic.Field(ge=0.0)] = 0.0
  """Weight of the router z-loss, mean(logsumexp(router logits)^2) (ST-MoE)."""
  dense_layers: tuple[Annotated[int, pydantic.Field(ge=0)], ...] = ()
  """Layers whose feed-forward stays a dense MLP (Qwen3-MoE's mlp_only_layers)."""
  sparse_step: PositiveInt = 1
  """Layer i is a MoE layer when (i + 1) % sparse_step == 0 and it is not in
  `dense_layers` (Qwen3-MoE's decoder_sparse_step)."""
  shared_expert_dim: PositiveInt | None = None
  """Hidden units of a shared expert: a gated MLP every token runs beside its routed
  experts, its output added to theirs (Qwen2-MoE's shared_expert_intermediate_size);
  None: no shared expert."""
  shared_expert_gate: bool = False
  """Scale the shared expert's output by sigmoid(x . w), w a [d_model] vector learned
  with it (Qwen2-MoE's shared_expert_gate)."""
  router_bias: bool = False
  """A learned bias on the router's logits (GPT-OSS's `router.bias`)."""
  expert_bias: bool = False
  """Biases on each expert's gate/up and down projections (GPT-OSS's)."""
  interleaved_gate_up: bool = False
  """Each expert's gate and up projections are one [E, d_model, 2 * f] weight, `gate_up_proj`,
  the gate in the even columns and the up in the odd (GPT-OSS's layout, kept as it is)."""
  router_score: Literal["softmax", "sigmoid"] = "softmax"
  """The chosen experts' weights: their probabilities of the softmax over every logit, or
  ("sigmoid", Llama 4's and DeepSeek-V3's) the sigmoid of each chosen logit alone, top-k of
  the sigmoids (plus `score_correction`'s bias, within `router_groups`)."""
  score_correction: bool = False
  """A per-expert bias added to the sigmoid scores to choose the experts, not to weight them
  (DeepSeek-V3's `e_score_correction_bias`, its auxiliary-loss-free balancing). It has no
  gradient (it moves only the top-k's choice): training leaves it as imported, or moves it
  by `correction_update`."""
  correction_update: NonNegativeFloat = 0.0
  """DeepSeek-V3's auxiliary-loss-free balancing: at each optimizer update each expert's
  `correction_bias` moves by this much, up where the expert took less than its share of the
  update's tokens (1 / num_experts), down where more, so the choice balances without a loss
  (the paper's bias update speed, 0.001). 0: the bias is left as it is."""
  router_groups: PositiveInt = 1
  """The experts split into this many equal groups, each scored by the sum of its two best
  (corrected) scores; a token chooses only among the experts of its `router_topk_groups` best
  groups (DeepSeek-V3's `n_group`, `topk_group`: group-limited routing)."""
  router_topk_groups: PositiveInt = 1
  """The groups a token's experts come from (all of them: `router_groups`)."""
  routed_scale: PositiveFloat = 1.0
  """Multiplies the routed experts' weights, after any renormalisation (DeepSeek-V3's
  `routed_scaling_factor`)."""
  weight_inputs: bool = False
  """The router's weight scales the token going into each chosen expert, expert(w * x),
  instead of what comes out, w * expert(x) (Llama 4's; the same for a linear expert only)."""
  expert_activation: Literal["gated", "clamped_swiglu"] = "gated"
  """The experts' MLP: "gated", act(gate) * up with the model's `mlp_activation`; or GPT-OSS's
  "clamped_swiglu": gate clamped above at `swiglu_limit`, up to +-`swiglu_limit`, then
  (up + 1) * gate * sigmoid(`swiglu_alpha` * gate)."""
  swiglu_alpha: PositiveFloat = 1.702
  """The clamped SwiGLU's sigmoid gain."""
  swiglu_limit: PositiveFloat = 7.0
  """The clamped SwiGLU's clamp."""
  grouped_matmul: GroupedMatmul = "auto"
  """How the experts run: "tokamax" (tokamax.ragged_dot: Mosaic/Triton on GPU and TPU,
  XLA on CPU), "xla" (jax.lax.ragged_dot), "blocked" (each expert's rows padded to
  blocks, one batched matmul: the fast one on CPU), "dense" (every expert on every
  token, masked: the reference); "auto": blocked on CPU, else tokamax (`kernels.experts`)."""

  def __post_init__(self):
    if self.shared_expert_gate and self.shared_expert_dim is None:
      raise ValueError("moe.shared_expert_gate=true needs a shared expert: set "
                       "moe.shared_expert_dim")
    if self.num_experts_per_tok > self.num_experts:
      raise ValueError(f"moe.num_experts_per_tok={self.num_experts_per_tok} is above "
                       f"moe.num_experts={self.num_experts}: a token cannot pick more experts "
                       "than there are")
    if self.correction_update and not self.score_correction:
      raise ValueError(f"moe.correction_update={self.correction_update} moves the choice's "
                       "bias: it needs moe.score_correction=true")
    if (self.score_correction or self.router_groups > 1) and self.router_score != "sigmoid":
      raise ValueError("moe.score_correction and moe.router_groups are DeepSeek's sigmoid "
                       "routing: set moe.router_score=sigmoid")
    groups, chosen = self.router_groups, self.router_topk_groups
    if self.num_experts % groups or chosen > groups or (
        groups > 1 and self.num_experts // groups < 2):
      raise ValueError(f"moe.router_groups={groups} must split moe.num_experts="
                       f"{self.num_experts} into equal groups of at least 2, and "
                       f"moe.router_topk_groups={chosen} be at most that many")
    if groups > 1 and chosen * (self.num_experts // groups) < self.num_experts_per_tok:
      raise ValueError(f"moe.router_topk_groups={chosen} groups of {self.num_experts // groups} "
                       f"experts hold fewer than moe.num_experts_per_tok="
                       f"{self.num_experts_per_tok}")
