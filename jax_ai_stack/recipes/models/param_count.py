"""A decoder's parameter count and training FLOPs per token, from its config's shapes alone
(`DecoderConfig.num_params`, `DecoderConfig.flops_per_token`; no arrays are built).

Example:
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> num_params(DecoderConfig.tiny()) == DecoderConfig.tiny().num_params()
  True
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from jax_ai_stack.recipes.models.configs import DecoderConfig


def num_params(config: DecoderConfig) -> int:
  """Every parameter: the embedding, each block's, the final norm and an untied head."""
  embed = config.padded_vocab_size * config.d_model
  norms = (2 * config.pre_norms + 2 * config.post_norms) * config.d_model
  blocks = sum(_matmul_params(config, layer, active=False) + _other_params(config, layer)
               + norms for layer in range(config.num_layers))
  head = 0 if config.tie_embeddings else embed
  return embed + blocks + config.d_model + head  # + the final norm


def flops_per_token(config: DecoderConfig, seq_len: int) -> int:
  """Training FLOPs per token (forward + backward), as PaLM counts them for MFU.

  6 per weight of every matmul a token goes through (the output head is one, tied
  or not, with its padded rows, which it computes; the embedding lookup is not;
  of a MoE layer the router and the `num_experts_per_tok` experts it picks) plus
  12 * heads * head_dim * seq_len per attention layer for the scores and their
  weighted sum, not halved for the causal mask, and 18 * its state's features per
  gated DeltaNet layer (three products with the state a token, forward).
  """
  matmul_weights = (sum(_matmul_params(config, layer, active=True)
                        for layer in range(config.num_layers))
                    + config.padded_vocab_size * config.d_model)
  types = config.resolved_layer_types
  linear = types.count("linear")
  attention = 12 * (len(types) - linear) * config.num_heads * config.resolved_head_dim * seq_len
  if linear:
    attention += 18 * linear * config.linear_attention.state_features
  return 6 * matmul_weights + attention


def _attention_matmul_params(config: DecoderConfig, layer: int) -> int:
  d, h = config.d_model, config.resolved_head_dim
  if config.resolved_layer_types[layer] == "linear":
    s = config.linear_attention
    return d * (2 * s.num_key_heads * s.key_head_dim + 2 * s.num_value_heads * s.value_head_dim
                + 2 * s.num_value_heads) + s.num_value_heads * s.value_head_dim * d
  if (latent := config.latent_attention) is not None:
    r, q_rank, n = latent.kv_lora_rank, latent.q_lora_rank, config.num_heads
    queries = d * n * h if q_rank is None else q_rank * (d + n * h)
    return (queries + d * (r + latent.qk_rope_head_dim)
            + r * n * (latent.qk_nope_head_dim + latent.v_head_dim) + n * latent.v_head_dim * d)
  queries = config.num_heads * (2 + config.attention_output_gate)  # q (and its gate), o.
  return d * h * (queries + 2 * config.num_kv_heads)


def _matmul_params(config: DecoderConfig, layer: int, *, active: bool) -> int:
  """Matmul weights of `layer`: all of them, or (`active`) those one token uses."""
  d = config.d_model
  attention = _attention_matmul_params(config, layer)
  if not config.moe_layers[layer]:
    return attention + 3 * d * config.mlp_dim
  moe = config.moe
  experts = moe.num_experts_per_tok if active else moe.num_experts
  shared = 3 * d * (moe.shared_expert_dim or 0) + d * moe.shared_expert_gate
  return attention + d * moe.num_experts + experts * 3 * d * config.expert_mlp_dim + shared


def _other_params(config: DecoderConfig, layer: int) -> int:
  """`layer`'s parameters outside its matmuls and block norms: q/k norms, biases, sinks, a
  latent's norms, a gated DeltaNet's convolution and per-head vectors, MoE biases."""
  h, heads, kv_heads = config.resolved_head_dim, config.num_heads, config.num_kv_heads
  if config.resolved_layer_types[layer] == "linear":
    s = config.linear_attention
    other = s.conv_dim * s.conv_kernel + 2 * s.num_value_heads + s.value_head_dim
  else:
    qk_norms = 2 * h if config.qk_norm_scope == "head" else (heads + kv_heads) * h
    other = qk_norms if config.qk_norm else 0
    if (latent := config.latent_attention) is not None:  # Its latents' norms.
      other += (latent.q_lora_rank or 0) + latent.kv_lora_rank
    other += (heads * (1 + config.attention_output_gate) + 2 * kv_heads) * h \
        if config.qkv_bias else 0
    other += config.d_model * config.o_proj_bias + heads * config.attention_sinks
  if config.moe_layers[layer]:
    moe, f = config.moe, config.expert_mlp_dim
    other += moe.num_experts * (moe.router_bias + moe.score_correction
                                + moe.expert_bias * (2 * f + config.d_model))
  return other
