"""Mixtral (`MixtralForCausalLM`): Mistral's attention with a mixture of experts in every layer.

Each layer's experts are `block_sparse_moe.experts.{j}.w1/w3/w2` (gate, up, down:
what `save_pretrained` of transformers 5 writes, and the Hub's files) beside the
router `block_sparse_moe.gate`; every expert has `intermediate_size` hidden units
and the router's top-k weights are always renormalised.

Example:
  >>> FAMILY.read({"num_local_experts": 8, "num_experts_per_tok": 2}, "config.json")["moe"]
  {'num_experts': 8, 'num_experts_per_tok': 2, 'norm_topk_prob': True, 'router_aux_loss_coef': 0.001}
"""

from __future__ import annotations

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.models.hf.families import Experts, HFFamily, refuse

KEYS = ("sliding_window", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
        "router_jitter_noise", "output_router_logits")


def _read(hf, source):
  if hf.get("router_jitter_noise", 0.0):
    raise refuse(source, "router_jitter_noise", hf["router_jitter_noise"],
                 "the router here adds no noise")
  moe = {"num_experts": hf.get("num_local_experts", 8),
         "num_experts_per_tok": hf.get("num_experts_per_tok", 2), "norm_topk_prob": True,
         "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001))}
  return {"sliding_window": hf.get("sliding_window"), "moe": moe}


def _write(config):
  moe = config.moe
  if config.expert_mlp_dim != config.mlp_dim or not moe.norm_topk_prob or moe.sparse_step != 1 \
      or moe.dense_layers:
    raise ConfigError("Mixtral's layout has every layer sparse, experts of intermediate_size "
                     "and renormalised router weights: this model.moe cannot be written as it")
  return {"sliding_window": config.sliding_window, "num_local_experts": moe.num_experts,
          "num_experts_per_tok": moe.num_experts_per_tok,
          "router_aux_loss_coef": moe.router_aux_loss_coef, "router_jitter_noise": 0.0}


FAMILY = HFFamily("MixtralForCausalLM", "mixtral", "mixtral", keys=KEYS, read=_read,
                  write=_write, experts=Experts("block_sparse_moe", "gate",
                                                {"gate_proj": "w1", "up_proj": "w3",
                                                 "down_proj": "w2"}),
                  free=("sliding_window",))
