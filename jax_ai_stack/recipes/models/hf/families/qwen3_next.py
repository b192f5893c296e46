"""Qwen3-Next (`Qwen3NextForCausalLM`): gated DeltaNet layers (`linear_attn.*`, the
"linear_attention" entries of `layer_types`; `models.linear_attention`) between gated
full-attention layers (`self_attn.*`: q_proj makes [q, gate] per head, q/k norms), RoPE on
the first `partial_rotary_factor` (0.25) of each head's features, zero-centred RMSNorms
(`x * (1 + w)`, the gated DeltaNet's output norm aside), and Qwen2-MoE's experts with a gated
shared expert (every `decoder_sparse_step`-th layer not in `mlp_only_layers`).

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 4, "num_experts": 8,
  ...                       "linear_num_value_heads": 4, "linear_num_key_heads": 2},
  ...                      "config.json")
  >>> fields["layer_types"], fields["linear_attention"]["num_value_heads"]
  (('linear', 'linear', 'linear', 'full'), 4)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import Experts, HFFamily, refuse

LINEAR = {"num_key_heads": "linear_num_key_heads", "num_value_heads": "linear_num_value_heads",
          "key_head_dim": "linear_key_head_dim", "value_head_dim": "linear_value_head_dim",
          "conv_kernel": "linear_conv_kernel_dim"}
"""`LinearAttentionConfig` field -> its config.json key."""
DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
"""transformers' `Qwen3NextConfig` defaults (5.24.0)."""
KEYS = (*DEFAULTS, "attention_bias", "layer_types", "full_attention_interval",
        "partial_rotary_factor", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
        "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")
_TYPES = {"linear_attention": "linear", "full_attention": "full"}


def _read(hf, source):
  if hf.get("attention_bias"):
    raise refuse(source, "attention_bias", hf["attention_bias"], "the model has no biases")
  layers = hf.get("num_hidden_layers", 48)
  interval = hf.get("full_attention_interval", 4)
  names = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else
                                    "full_attention" for i in range(layers)]
  if len(names) != layers or any(name not in _TYPES for name in names):
    raise refuse(source, "layer_types", names, "expected linear_attention or full_attention "
                 "per layer")
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
  head_dim = hf.get("head_dim", 256)
  return dict(layer_types=tuple(_TYPES[name] for name in names), head_dim=head_dim,
              rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
              linear_attention={ours: hf.get(theirs, DEFAULTS[theirs])
                                for ours, theirs in LINEAR.items()},
              moe=dict(num_experts=hf.get("num_experts", 512),
                       num_experts_per_tok=hf.get("num_experts_per_tok", 10),
                       expert_mlp_dim=hf.get("moe_intermediate_size", 512),
                       shared_expert_dim=hf.get("shared_expert_intermediate_size", 512),
                       shared_expert_gate=True, sparse_step=hf.get("decoder_sparse_step", 1),
                       dense_layers=tuple(hf.get("mlp_only_layers") or ()),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                       router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001))))


def _write(config):
  moe, linear = config.moe, config.linear_attention
  back = {ours: theirs for theirs, ours in _TYPES.items()}
  rotary = (config.rotary_dim or config.resolved_head_dim) / config.resolved_head_dim
  return {**{theirs: getattr(linear, ours) for ours, theirs in LINEAR.items()},
          "attention_bias": False, "head_dim": config.resolved_head_dim,
          "layer_types": [back[t] for t in config.resolved_layer_types],
          "partial_rotary_factor": rotary, "num_experts": moe.num_experts,
          "num_experts_per_tok": moe.num_experts_per_tok,
          "moe_intermediate_size": config.expert_mlp_dim,
          "shared_expert_intermediate_size": moe.shared_expert_dim,
          "decoder_sparse_step": moe.sparse_step, "mlp_only_layers": list(moe.dense_layers),
          "norm_topk_prob": moe.norm_topk_prob, "router_aux_loss_coef": moe.router_aux_loss_coef}


FAMILY = HFFamily("Qwen3NextForCausalLM", "qwen3_next", "qwen3_next", keys=KEYS, read=_read,
                  write=_write, linear_attention=True,
                  experts=Experts("mlp", "gate", {name: name for name in (
                      "gate_proj", "up_proj", "down_proj")}, shared_expert="shared_expert",
                                  shared_expert_gate="shared_expert_gate"),
                  switches=dict(qk_norm=True, norm_offset=1.0, attention_output_gate=True),
                  free=("layer_types", "rotary_dim"))
