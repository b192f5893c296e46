"""Gemma 2 (`Gemma2ForCausalLM`): (1 + w) norms, four per block, GeGLU, scaled embeddings,
`query_pre_attn_scalar`, both soft caps, and a window on every other layer.

The switches it has on come with `kind: gemma2` (`SWITCHES`, which `DecoderConfig`
fills in); this file reads the ones a checkpoint varies (`FREE`).

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 2, "sliding_window": 8,
  ...                       "attn_logit_softcapping": 50.0}, "config.json")
  >>> fields["layer_types"], fields["attn_logit_softcap"], fields["final_logit_softcap"]
  (('sliding', 'full'), 50.0, None)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import (
    HFFamily, read_layer_types, refuse, write_layer_types)

NORMS = {"attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm"}
SWITCHES = dict(norm_offset=1.0, post_norms=True, embed_scale=True, mlp_activation="gelu_tanh")
FREE = ("qkv_bias", "attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
        "layer_types", "sliding_window")
KEYS = ("hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping",
        "final_logit_softcapping", "sliding_window", "layer_types", "attention_bias",
        "use_bidirectional_attention", "cache_implementation")


def read_gemma(hf, source, default_types):
  """The switches Gemma 2 and 3 share."""
  if hf.get("use_bidirectional_attention"):
    raise refuse(source, "use_bidirectional_attention", True, "the decoder is causal")
  return {
      "qkv_bias": bool(hf.get("attention_bias", False)),
      "query_pre_attn_scalar": hf.get("query_pre_attn_scalar", 256),
      "attn_logit_softcap": hf.get("attn_logit_softcapping"),
      "final_logit_softcap": hf.get("final_logit_softcapping"),
      **read_layer_types(hf, source, default_types),
  }


def write_gemma(config):
  return {
      "attention_bias": config.qkv_bias,
      "query_pre_attn_scalar": config.query_pre_attn_scalar or config.resolved_head_dim,
      "attn_logit_softcapping": config.attn_logit_softcap,
      "final_logit_softcapping": config.final_logit_softcap,
      "sliding_window": config.sliding_window,
      "layer_types": write_layer_types(config),
  }


def _read(hf, source):
  default = ["sliding_attention" if i % 2 == 0 else "full_attention"
             for i in range(hf.get("num_hidden_layers", 0))]
  return read_gemma(hf, source, default)


FAMILY = HFFamily("Gemma2ForCausalLM", "gemma2", "gemma2", keys=KEYS, read=_read,
                  write=write_gemma, activation_key="hidden_activation",
                  activation="gelu_pytorch_tanh", norms=NORMS, switches=SWITCHES, free=FREE,
                  ties_embeddings=True)
