"""SmolLM3 (`SmolLM3ForCausalLM`): Llama with NoPE layers, whose attention has no RoPE.

config.json's `no_rope_layers` has one entry per layer, 1 where the layer rotates q and k
and 0 where it does not (`nope_layers` lists the 0s); without it, every
`no_rope_layer_interval`-th layer (4) is NoPE. With `use_sliding_window` the layers
`layer_types` names (by default the NoPE ones) attend within `sliding_window`. Biases
(`attention_bias`, `mlp_bias`) are refused.

Example:
  >>> FAMILY.read({"num_hidden_layers": 8}, "config.json")["nope_layers"]
  (3, 7)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import (
    HFFamily, read_layer_types, read_rope_flags, refuse, write_layer_types)

KEYS = ("attention_bias", "mlp_bias", "no_rope_layers", "no_rope_layer_interval",
        "use_sliding_window", "sliding_window", "layer_types")


def _read(hf, source):
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      raise refuse(source, field, hf[field], "the model has no biases")
  layers = hf.get("num_hidden_layers", 0)
  uses_rope = read_rope_flags(hf, source, one_per_layer=False)
  nope = tuple(i for i in range(layers) if not uses_rope[i])
  if not hf.get("use_sliding_window"):
    if "sliding_attention" in (hf.get("layer_types") or ()):
      raise refuse(source, "layer_types", hf["layer_types"], "names sliding layers while "
                   "use_sliding_window is false (transformers' masks and attention disagree)")
    return {"nope_layers": nope, "layer_types": None, "sliding_window": None}
  default = ["full_attention" if flag else "sliding_attention" for flag in uses_rope[:layers]]
  return {"nope_layers": nope, **read_layer_types(hf, source, default)}


def _write(config):
  types = config.resolved_layer_types
  return {"attention_bias": False, "mlp_bias": False,
          "no_rope_layers": [int(i not in config.nope_layers) for i in range(config.num_layers)],
          "use_sliding_window": "sliding" in types, "sliding_window": config.sliding_window,
          "layer_types": write_layer_types(config),
          "pad_token_id": None}  # Not transformers' default, past a small vocabulary (an
  # nn.Embedding's padding_idx); export-hf's token ids replace it.


FAMILY = HFFamily("SmolLM3ForCausalLM", "smollm3", "smollm3", keys=KEYS, read=_read,
                  write=_write, free=("nope_layers", "layer_types", "sliding_window"),
                  ties_embeddings=True)
