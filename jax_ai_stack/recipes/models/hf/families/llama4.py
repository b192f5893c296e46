"""Llama 4's text model (`Llama4ForCausalLM`): chunked local attention on the RoPE layers,
NoPE global layers with a temperature, an L2 norm on q and k, and interleaved MoE layers
with a shared expert and top-1 sigmoid routing.

Every `interleave_moe_layer_step`-th layer (or those `moe_layers` lists) is a mixture of
experts under `feed_forward`: a router (`feed_forward.router`) whose top-k logits' sigmoids
scale each chosen expert's input, the experts stacked as `experts.gate_up_proj` [E, d, 2f]
(gate, then up) and `experts.down_proj` [E, f, d], and an ungated shared expert
(`feed_forward.shared_expert.*`), all of `intermediate_size`; the other layers' dense MLP
(`feed_forward.*`) has `intermediate_size_mlp`. Layers with RoPE (`no_rope_layers` 1) attend
within chunks of `attention_chunk_size` and, with `use_qk_norm`, normalise q and k after
RoPE; the NoPE layers attend to everything, their queries scaled by the temperature
(`attn_temperature_tuning`, `floor_scale`, `attn_scale`). transformers' RoPE turns complex
pairs (2i, 2i + 1): q_proj and k_proj are reordered on import (`interleaved_rope`).
`Llama4ForConditionalGeneration` (the released text + vision checkpoints) is read as its text
model (`text_config`, `language_model.*`); the vision model is not read.

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 4, "interleave_moe_layer_step": 2,
  ...                       "intermediate_size": 8}, "config.json")
  >>> fields["layer_types"], fields["nope_layers"], fields["moe"]["dense_layers"]
  (('chunked', 'chunked', 'chunked', 'full'), (3,), (0, 2))
"""

from __future__ import annotations

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.models.hf.families import Experts, HFFamily, read_rope_flags, refuse

KEYS = ("intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "moe_layers",
        "interleave_moe_layer_step", "use_qk_norm", "output_router_logits",
        "router_aux_loss_coef", "router_jitter_noise", "no_rope_layers", "no_rope_layer_interval",
        "attention_chunk_size", "layer_types", "attn_temperature_tuning", "floor_scale",
        "attn_scale", "attention_bias", "for_llm_compressor")
MOE = dict(norm_topk_prob=False, router_score="sigmoid", weight_inputs=True)
_TYPES = {"full_attention": "full", "chunked_attention": "chunked"}


def _read(hf, source):
  for field in ("attention_bias", "router_jitter_noise"):
    if hf.get(field):
      raise refuse(source, field, hf[field], "Llama 4's text model has neither")
  layers = hf.get("num_hidden_layers", 0)
  uses_rope = read_rope_flags(hf, source, one_per_layer=True)
  chunk = hf.get("attention_chunk_size", 8192)
  names = hf.get("layer_types") or [
      "chunked_attention" if flag and chunk is not None else "full_attention" for flag in uses_rope]
  if len(names) != layers or any(name not in _TYPES for name in names):
    raise refuse(source, "layer_types", names, "expected full_attention or chunked_attention "
                 "per layer")
  types = tuple(_TYPES[name] for name in names)
  step = hf.get("interleave_moe_layer_step", 1)
  sparse = hf.get("moe_layers")
  sparse = list(range(step - 1, layers, step)) if sparse is None else list(sparse)
  if not sparse:
    raise refuse(source, "moe_layers", sparse, "a Llama 4 model without MoE layers is not read")
  dense = tuple(i for i in range(layers) if i not in sparse)
  experts = hf.get("intermediate_size", 8192)
  moe = dict(num_experts=hf.get("num_local_experts", 16),
             num_experts_per_tok=hf.get("num_experts_per_tok", 1), expert_mlp_dim=experts,
             shared_expert_dim=experts, dense_layers=dense,
             router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), **MOE)
  temperature = (float(hf.get("floor_scale", 8192)), float(hf.get("attn_scale", 0.1)))
  rope = {} if any(hf.get(key) for key in ("rope_theta", "rope_scaling", "rope_parameters")) \
      else dict(rope_theta=500_000.0)  # Llama4TextConfig's default_theta.
  return dict(mlp_dim=hf.get("intermediate_size_mlp", 16384), moe=moe, **rope,
              nope_layers=tuple(i for i in range(layers) if not uses_rope[i]),
              layer_types=None if set(types) == {"full"} else types,
              attention_chunk_size=chunk if "chunked" in types else None,
              qk_l2_norm=bool(hf.get("use_qk_norm", True)),
              nope_temperature=temperature if hf.get("attn_temperature_tuning", True) else None)


def _write(config):
  moe = config.moe
  layers = range(config.num_layers)
  if moe.shared_expert_dim != config.expert_mlp_dim or moe.sparse_step != 1:
    raise ConfigError("Llama 4's layout has a shared expert as wide as the experts "
                      "(moe.shared_expert_dim = moe.expert_mlp_dim) and its MoE layers listed "
                      "(moe.dense_layers, moe.sparse_step 1): this model cannot be written as it")
  types = {"full": "full_attention", "chunked": "chunked_attention"}
  temperature = config.nope_temperature or (8192.0, 0.1)
  return {"intermediate_size": config.expert_mlp_dim, "intermediate_size_mlp": config.mlp_dim,
          "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.num_experts_per_tok,
          "moe_layers": [i for i in layers if config.moe_layers[i]],
          "interleave_moe_layer_step": 1, "router_aux_loss_coef": moe.router_aux_loss_coef,
          "router_jitter_noise": 0.0, "attention_bias": False,
          "no_rope_layers": [int(i not in config.nope_layers) for i in layers],
          "attention_chunk_size": config.attention_chunk_size,
          "layer_types": [types[t] for t in config.resolved_layer_types],
          "use_qk_norm": config.qk_l2_norm,
          "attn_temperature_tuning": config.nope_temperature is not None,
          "floor_scale": int(temperature[0]), "attn_scale": temperature[1]}


FAMILY = HFFamily("Llama4ForCausalLM", "llama4_text", "llama4", keys=KEYS, read=_read,
                  write=_write, mlp="feed_forward", interleaved_rope=True,
                  experts=Experts("feed_forward", "router", {name: name for name in (
                      "gate_proj", "up_proj", "down_proj")}, shared_expert="shared_expert",
                                  stacked=True, fused={"gate_up_proj": ("gate_proj", "up_proj")},
                                  moe=MOE),
                  free=("nope_layers", "layer_types", "attention_chunk_size", "qk_l2_norm",
                        "nope_temperature"))
