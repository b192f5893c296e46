"""GPT-OSS (`GptOssForCausalLM`): attention sinks, alternating sliding and full layers, YaRN,
biases on every attention projection, and experts with biases and a clamped SwiGLU.

Every layer is a mixture of experts (`mlp.router` with a bias; top-k of the logits, their
softmax: the renormalised top-k) whose experts are stacked tensors in our own layout,
`mlp.experts.gate_up_proj` [E, d, 2f] (gate and up interleaved) with `gate_up_proj_bias`,
and `down_proj` [E, f, d] with `down_proj_bias`. Each attention has q/k/v/o biases
(`attention_bias`) and a sink logit per head (`self_attn.sinks`). The even layers slide
(`layer_types`, read first). The released checkpoints are MXFP4: refused, naming the route
(transformers' dequantized save).

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 2, "num_local_experts": 4,
  ...                       "sliding_window": 8}, "config.json")
  >>> fields["layer_types"], fields["moe"]["expert_activation"], fields["o_proj_bias"]
  (('sliding', 'full'), 'clamped_swiglu', True)
"""

from __future__ import annotations

from collections.abc import Mapping

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.models.hf.families import (
    Experts, HFFamily, read_layer_types, refuse, write_layer_types)

KEYS = ("attention_bias", "sliding_window", "layer_types", "num_local_experts", "num_experts",
        "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "router_aux_loss_coef",
        "output_router_logits", "quantization_config", "experts_per_token",
        "initial_context_length")
"""The last two are in the released config.json beside their transformers names
(`num_experts_per_tok`, the YaRN's original_max_position_embeddings), which transformers
reads instead: read as it does, ignored."""
MOE = dict(norm_topk_prob=True, router_bias=True, expert_bias=True, interleaved_gate_up=True,
           expert_activation="clamped_swiglu")
DEQUANTIZE = ("its expert weights are MXFP4 blocks, which are not read: save a dequantized "
              "copy with transformers (GptOssForCausalLM.from_pretrained(path, "
              "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16)"
              ".save_pretrained(out)) and import that")


DEFAULT_YARN = dict(kind="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)


def _read(hf, source):
  quantization = hf.get("quantization_config")
  if quantization:
    method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
    raise refuse(source, "quantization_config.quant_method", method, DEQUANTIZE)
  default = ["sliding_attention" if (i + 1) % 2 else "full_attention"
             for i in range(hf.get("num_hidden_layers", 0))]
  bias = bool(hf.get("attention_bias", True))
  moe = {"num_experts": hf.get("num_local_experts", hf.get("num_experts", 128)),
         "num_experts_per_tok": hf.get("num_experts_per_tok", 4),
         "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
         "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
         "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)), **MOE}
  rope = {}
  if not any(hf.get(key) for key in ("rope_theta", "rope_scaling", "rope_parameters")):
    rope = dict(rope_theta=150_000.0, rope_scaling=DEFAULT_YARN)  # GptOssConfig's defaults.
  return {"qkv_bias": bias, "o_proj_bias": bias, "moe": moe, **rope,
          **read_layer_types({"sliding_window": 128, **hf}, source, default)}


def _write(config):
  moe = config.moe
  if config.qkv_bias != config.o_proj_bias or config.expert_mlp_dim != config.mlp_dim or (
      moe.sparse_step != 1 or moe.dense_layers or moe.shared_expert_dim is not None
      or not moe.norm_topk_prob):
    raise ConfigError("GPT-OSS's layout has q/k/v and o biases together (attention_bias), "
                      "every layer sparse with experts of intermediate_size, renormalised "
                      "router weights and no shared expert: this model cannot be written as it")
  return {"attention_bias": config.qkv_bias, "sliding_window": config.sliding_window,
          "layer_types": write_layer_types(config), "num_local_experts": moe.num_experts,
          "num_experts_per_tok": moe.num_experts_per_tok, "swiglu_alpha": moe.swiglu_alpha,
          "swiglu_limit": moe.swiglu_limit, "router_aux_loss_coef": moe.router_aux_loss_coef}


FAMILY = HFFamily("GptOssForCausalLM", "gpt_oss", "gpt_oss", keys=KEYS, read=_read,
                  write=_write,
                  experts=Experts("mlp", "router", {name: name for name in (
                      "gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")},
                                  stacked=True, moe=MOE),
                  switches=dict(attention_sinks=True, qkv_bias=True, o_proj_bias=True),
                  free=("qkv_bias", "o_proj_bias", "layer_types", "sliding_window"))
