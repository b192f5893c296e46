"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention with mixtures of experts.

Layer i is sparse when (i + 1) % `decoder_sparse_step` == 0 and i is not in
`mlp_only_layers` (those keep a dense MLP of `intermediate_size`); each expert has
`moe_intermediate_size` hidden units, as `mlp.experts.{j}.gate_proj/up_proj/down_proj`
beside the router `mlp.gate`. `norm_topk_prob` says whether the router's top-k
weights are renormalised. transformers 5 writes the expert count as
`num_local_experts`, earlier files as `num_experts`: both are read.

Example:
  >>> moe = FAMILY.read({"num_experts": 4, "moe_intermediate_size": 8,
  ...                    "mlp_only_layers": [1]}, "config.json")["moe"]
  >>> moe["num_experts"], moe["expert_mlp_dim"], moe["dense_layers"], moe["norm_topk_prob"]
  (4, 8, (1,), False)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import Experts, HFFamily
from jax_ai_stack.recipes.models.hf.families.qwen2 import SLIDING_KEYS, read_sliding, write_sliding

KEYS = ("attention_bias", *SLIDING_KEYS, "num_experts", "num_local_experts",
        "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
        "norm_topk_prob", "router_aux_loss_coef", "output_router_logits")


def _read(hf, source):
  moe = {"num_experts": hf.get("num_local_experts", hf.get("num_experts", 128)),
         "num_experts_per_tok": hf.get("num_experts_per_tok", 8),
         "expert_mlp_dim": hf.get("moe_intermediate_size", 768),
         "sparse_step": hf.get("decoder_sparse_step", 1),
         "dense_layers": tuple(hf.get("mlp_only_layers") or ()),
         "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
         "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001))}
  return {"qkv_bias": bool(hf.get("attention_bias", False)), **read_sliding(hf, source),
          "moe": moe}


def _write(config):
  moe = config.moe
  return {"attention_bias": config.qkv_bias, **write_sliding(config),
          "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
          "moe_intermediate_size": config.expert_mlp_dim, "decoder_sparse_step": moe.sparse_step,
          "mlp_only_layers": list(moe.dense_layers), "norm_topk_prob": moe.norm_topk_prob,
          "router_aux_loss_coef": moe.router_aux_loss_coef}


FAMILY = HFFamily("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3_moe", keys=KEYS, read=_read,
                  write=_write, experts=Experts("mlp", "gate", {"gate_proj": "gate_proj",
                                                                "up_proj": "up_proj",
                                                                "down_proj": "down_proj"}),
                  switches=dict(qk_norm=True), free=("qkv_bias", "layer_types", "sliding_window"))
