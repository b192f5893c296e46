"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases) with mixtures of
experts and a gated shared expert.

Each sparse layer (as Qwen3-MoE: every `decoder_sparse_step`-th, not in `mlp_only_layers`)
holds routed experts of `moe_intermediate_size` (`mlp.experts.{j}.gate_proj/up_proj/
down_proj`, router `mlp.gate`) and a shared expert every token runs, a gated MLP of
`shared_expert_intermediate_size` (`mlp.shared_expert.*`) scaled by the sigmoid of
`mlp.shared_expert_gate` ([1, d_model]). Its sliding layers, with `use_sliding_window`,
are the even ones below `max_window_layers` (transformers 5 writes `layer_types`, read first). Its config reads the expert count
as `num_experts` only (Qwen3-MoE's also as `num_local_experts`), which is what is written.

Example:
  >>> moe = FAMILY.read({"num_experts": 4, "moe_intermediate_size": 8,
  ...                    "shared_expert_intermediate_size": 16}, "config.json")["moe"]
  >>> moe["shared_expert_dim"], moe["shared_expert_gate"], moe["norm_topk_prob"]
  (16, True, False)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import (
    Experts, HFFamily, read_layer_types, write_layer_types)
from jax_ai_stack.recipes.models.hf.families import qwen3_moe

KEYS = ("qkv_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
        "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
        "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")


def _read_sliding(hf, source):
  if not hf.get("use_sliding_window"):
    return dict(layer_types=None, sliding_window=None)
  below = hf.get("max_window_layers", 28)
  default = ["sliding_attention" if (i + 1) % 2 and i < below else "full_attention"
             for i in range(hf.get("num_hidden_layers", 0))]
  return read_layer_types(hf, source, default)


def _read(hf, source):
  fields = qwen3_moe.FAMILY.read({**hf, "use_sliding_window": False}, source)
  fields["moe"].update(shared_expert_dim=hf.get("shared_expert_intermediate_size", 5632),
                       shared_expert_gate=True)
  return {**fields, "qkv_bias": bool(hf.get("qkv_bias", True)), **_read_sliding(hf, source)}


def _write(config):
  fields = qwen3_moe.FAMILY.write(config)
  for key in ("attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
              "layer_types", "num_local_experts"):
    fields.pop(key)
  sliding = "sliding" in config.resolved_layer_types
  return {**fields, "num_experts": config.moe.num_experts, "qkv_bias": config.qkv_bias, "use_sliding_window": sliding,
          "sliding_window": config.sliding_window, "layer_types": write_layer_types(config),
          "max_window_layers": config.num_layers,
          "shared_expert_intermediate_size": config.moe.shared_expert_dim}


FAMILY = HFFamily("Qwen2MoeForCausalLM", "qwen2_moe", "qwen2_moe", keys=KEYS, read=_read,
                  write=_write,
                  experts=Experts("mlp", "gate", {"gate_proj": "gate_proj", "up_proj": "up_proj",
                                                  "down_proj": "down_proj"},
                                  shared_expert="shared_expert",
                                  shared_expert_gate="shared_expert_gate"),
                  switches=dict(qkv_bias=True), free=("qkv_bias", "layer_types", "sliding_window"))
