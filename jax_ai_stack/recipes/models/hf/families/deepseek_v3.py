"""DeepSeek-V3 (`DeepseekV3ForCausalLM`; Kimi-K2's and Moonlight's layout too): multi-head latent
attention (`models.latent_attention`), its RoPE features paired as (2i, 2i + 1)
(`rope_interleave`, reordered on import), and mixtures of experts from layer
`first_k_dense_replace` on.

Its experts (`mlp.experts.{j}.*`, router `mlp.gate` with the choice-only
`e_score_correction_bias`) are routed by sigmoid scores within the `topk_group` best of
`n_group` groups, weighted by `routed_scaling_factor`, beside `n_shared_experts` ungated
shared experts (`mlp.shared_experts.*`, one MLP as wide as all of them). YaRN's `mscale` and
`mscale_all_dim` are read (`RopeScaling`). Multi-token prediction layers (`layers.{N}.*`
past `num_hidden_layers`) are not read: import leaves them out and says so. Refused in one
line: attention biases, non-interleaved RoPE, another `scoring_func` or `topk_method`, MoE
layers other than every layer from `first_k_dense_replace` on, and the released FP8 weights
(`quantization_config`: the refusal names transformers' dequantizing save, whose bfloat16
copy imports).

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 2, "num_attention_heads": 4,
  ...                       "first_k_dense_replace": 1, "q_lora_rank": None,
  ...                       "kv_lora_rank": 16, "qk_rope_head_dim": 4, "n_routed_experts": 8,
  ...                       "n_group": 4, "topk_group": 2, "moe_intermediate_size": 8,
  ...                       "n_shared_experts": 2}, "config.json")
  >>> fields["latent_attention"]["kv_lora_rank"], fields["head_dim"], fields["num_kv_heads"]
  (16, 132, 4)
  >>> moe = fields["moe"]
  >>> moe["dense_layers"], moe["router_groups"], moe["router_topk_groups"], moe["shared_expert_dim"]
  ((0,), 4, 2, 16)
"""

from __future__ import annotations

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.models.hf.families import Experts, HFFamily, refuse

LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128}
"""transformers' `DeepseekV3Config` defaults (5.24.0)."""
MOE = dict(router_score="sigmoid", score_correction=True)
ROUTING = ("router_groups", "router_topk_groups", "routed_scale")
KEYS = (*LATENT_KEYS, "qk_head_dim", "rope_interleave", "attention_bias", "n_routed_experts",
        "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace", "n_group",
        "topk_group", "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor",
        "num_nextn_predict_layers", "num_mtp_layers", "moe_layer_freq", "topk_method",
        "scoring_func", "ep_size", "aux_loss_alpha", "seq_aux", "output_router_logits",
        "pretraining_tp", "num_local_experts", "quantization_config")
DEQUANTIZE = ("its weights are FP8 blocks with scales (weight_scale_inv), which are not read: "
              "save a dequantized copy with transformers (AutoModelForCausalLM.from_pretrained("
              "path, quantization_config=FineGrainedFP8Config(dequantize=True), "
              "dtype=torch.bfloat16).save_pretrained(out)) and import that")


def _read(hf, source):
  if quantization := hf.get("quantization_config"):
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    raise refuse(source, "quantization_config.quant_method", method, DEQUANTIZE)
  if hf.get("attention_bias"):
    raise refuse(source, "attention_bias", hf["attention_bias"], "the model has no biases")
  if not hf.get("rope_interleave", True):
    raise refuse(source, "rope_interleave", hf["rope_interleave"], "DeepSeek's RoPE pairs "
                 "features (2i, 2i + 1), which import reorders; the other order is not read")
  heads = hf.get("num_attention_heads", 128)
  if hf.get("num_key_value_heads", heads) != heads:
    raise refuse(source, "num_key_value_heads", hf["num_key_value_heads"],
                 f"latent attention makes keys and values for all {heads} heads")
  latent = {key: hf.get(key, DEFAULTS[key]) for key in LATENT_KEYS}
  return dict(latent_attention=latent, num_kv_heads=heads, moe=_read_moe(hf, source),
              head_dim=latent["qk_nope_head_dim"] + latent["qk_rope_head_dim"])


def _read_moe(hf, source):
  """`DecoderConfig.moe`: DeepSeek's routing, transformers' defaults (5.24.0)."""
  for field, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                          ("moe_layer_freq", 1)):
    if hf.get(field) not in (None, expected):
      raise refuse(source, field, hf[field], f"DeepSeek-V3's routing ({field}={expected!r}) is "
                   "the one implemented")
  shared, width = hf.get("n_shared_experts", 1), hf.get("moe_intermediate_size", 2048)
  if not shared:
    raise refuse(source, "n_shared_experts", shared, "DeepSeek-V3's layout has shared experts")
  layers = hf.get("num_hidden_layers", 61)
  return dict(num_experts=hf.get("n_routed_experts", hf.get("num_local_experts", 256)),
              num_experts_per_tok=hf.get("num_experts_per_tok", 8), expert_mlp_dim=width,
              shared_expert_dim=shared * width,
              dense_layers=tuple(range(min(hf.get("first_k_dense_replace", 3), layers))),
              norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
              router_groups=hf.get("n_group", 8), router_topk_groups=hf.get("topk_group", 4),
              routed_scale=float(hf.get("routed_scaling_factor", 2.5)),
              router_aux_loss_coef=float(hf.get("aux_loss_alpha") or 0.0), **MOE)


def _write(config):
  latent, moe = config.latent_attention, config.moe
  dense = len(moe.dense_layers)
  shared, remainder = divmod(moe.shared_expert_dim, config.expert_mlp_dim)
  if moe.dense_layers != tuple(range(dense)) or moe.sparse_step != 1 or remainder:
    raise ConfigError("DeepSeek-V3's layout has its dense layers first (moe.dense_layers "
                      "0 ... k-1, moe.sparse_step 1) and shared experts as wide as the routed "
                      "ones (moe.shared_expert_dim a multiple of moe.expert_mlp_dim): this "
                      "model cannot be written as it")
  return {**{key: getattr(latent, key) for key in LATENT_KEYS},
          "head_dim": latent.qk_rope_head_dim,  # As transformers sets it.
          "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 0,
          "first_k_dense_replace": dense, "n_routed_experts": moe.num_experts,
          "num_experts_per_tok": moe.num_experts_per_tok,
          "moe_intermediate_size": config.expert_mlp_dim, "n_shared_experts": shared,
          "n_group": moe.router_groups, "topk_group": moe.router_topk_groups,
          "norm_topk_prob": moe.norm_topk_prob, "routed_scaling_factor": moe.routed_scale,
          "scoring_func": "sigmoid", "topk_method": "noaux_tc",
          "aux_loss_alpha": moe.router_aux_loss_coef}


FAMILY = HFFamily("DeepseekV3ForCausalLM", "deepseek_v3", "deepseek_v3", keys=KEYS,
                  read=_read, write=_write, latent_attention=True, interleaved_rope=True,
                  prediction_layers=True,
                  experts=Experts("mlp", "gate", {name: name for name in (
                      "gate_proj", "up_proj", "down_proj")}, shared_expert="shared_experts",
                                  correction_bias="e_score_correction_bias", moe=MOE,
                                  routing=ROUTING))
