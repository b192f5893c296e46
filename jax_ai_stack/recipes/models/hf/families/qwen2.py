"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Decoder with q/k/v biases and optional sliding layers.

Layers from `max_window_layers` on use the window when `use_sliding_window`
(transformers 5 writes the resulting `layer_types`, read first).

Example:
  >>> FAMILY.read({"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 6,
  ...              "max_window_layers": 1}, "config.json")
  {'layer_types': ('full', 'sliding', 'sliding'), 'sliding_window': 6}
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily, read_layer_types, write_layer_types

SLIDING_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


def read_sliding(hf, source):
  """Qwen's sliding layers: the window only with `use_sliding_window`."""
  if not hf.get("use_sliding_window"):
    return dict(layer_types=None, sliding_window=None)
  first = hf.get("max_window_layers", 28)
  default = ["sliding_attention" if i >= first else "full_attention"
             for i in range(hf.get("num_hidden_layers", 0))]
  return read_layer_types(hf, source, default)


def write_sliding(config):
  types = config.resolved_layer_types
  sliding = "sliding" in types
  return {"use_sliding_window": sliding, "sliding_window": config.sliding_window,
          "max_window_layers": types.index("sliding") if sliding else config.num_layers,
          "layer_types": write_layer_types(config)}


FAMILY = HFFamily("Qwen2ForCausalLM", "qwen2", "qwen2", keys=SLIDING_KEYS, read=read_sliding,
                  write=write_sliding, switches=dict(qkv_bias=True),
                  free=("layer_types", "sliding_window"))
