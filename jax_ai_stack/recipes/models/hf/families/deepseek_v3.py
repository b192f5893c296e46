"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; Kimi-K2's layout too): multi-head latent attention
(`models.latent_attention`), its RoPE features paired as (2i, 2i + 1) (`rope_interleave`,
reordered on import), dense MLPs.

Its mixtures of experts (sigmoid routing with a correction bias, group-limited top-k, a
routed scaling factor, shared experts) are not implemented yet: a config with a sparse layer
(`first_k_dense_replace` below `num_hidden_layers` with routed experts) is refused in one line,
as are attention biases, non-interleaved RoPE, and YaRN's `mscale` (by the shared reader).
Multi-token prediction layers are not read (`num_nextn_predict_layers` must be 0).

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 2, "num_attention_heads": 4,
  ...                       "first_k_dense_replace": 2, "q_lora_rank": None,
  ...                       "kv_lora_rank": 16, "qk_rope_head_dim": 4}, "config.json")
  >>> fields["latent_attention"]["kv_lora_rank"], fields["head_dim"], fields["num_kv_heads"]
  (16, 132, 4)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily, refuse

LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128}
"""transformers' `DeepseekV3Config` defaults (5.24.0)."""
KEYS = (*LATENT_KEYS, "qk_head_dim", "rope_interleave", "attention_bias", "n_routed_experts",
        "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace", "n_group",
        "topk_group", "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor",
        "num_nextn_predict_layers", "num_mtp_layers", "moe_layer_freq", "topk_method",
        "scoring_func", "ep_size", "aux_loss_alpha", "seq_aux", "output_router_logits",
        "pretraining_tp")


def _read(hf, source):
  if hf.get("attention_bias"):
    raise refuse(source, "attention_bias", hf["attention_bias"], "the model has no biases")
  if not hf.get("rope_interleave", True):
    raise refuse(source, "rope_interleave", hf["rope_interleave"], "DeepSeek's RoPE pairs "
                 "features (2i, 2i + 1), which import reorders; the other order is not read")
  for field in ("num_nextn_predict_layers", "num_mtp_layers"):
    if hf.get(field):
      raise refuse(source, field, hf[field], "multi-token prediction layers are not read: "
                   "set it to 0 (the decoder's logits do not use them)")
  layers, dense = hf.get("num_hidden_layers", 61), hf.get("first_k_dense_replace", 3)
  if hf.get("n_routed_experts", 256) and dense < layers:
    raise refuse(source, "first_k_dense_replace", dense,
                 f"layers {dense} and up of {layers} are mixtures of experts with DeepSeek's "
                 "sigmoid routing (correction bias, group-limited top-k), not implemented yet: "
                 "only a model whose every layer is dense imports")
  heads = hf.get("num_attention_heads", 128)
  if hf.get("num_key_value_heads", heads) != heads:
    raise refuse(source, "num_key_value_heads", hf["num_key_value_heads"],
                 f"latent attention makes keys and values for all {heads} heads")
  latent = {key: hf.get(key, DEFAULTS[key]) for key in LATENT_KEYS}
  return dict(latent_attention=latent, num_kv_heads=heads,
              head_dim=latent["qk_nope_head_dim"] + latent["qk_rope_head_dim"])


def _write(config):
  latent = config.latent_attention
  return {**{key: getattr(latent, key) for key in LATENT_KEYS},
          "head_dim": latent.qk_rope_head_dim,  # As transformers sets it.
          "rope_interleave": True, "attention_bias": False,
          "first_k_dense_replace": config.num_layers, "num_nextn_predict_layers": 0}


FAMILY = HFFamily("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek_v3", keys=KEYS,
                  read=_read, write=_write, latent_attention=True, interleaved_rope=True)
