"""OLMo 3 (`Olmo3ForCausalLM`): OLMo 2 with sliding-window layers (3 sliding : 1 full
unless `layer_types` says otherwise), whose RoPE has its own base and no scaling.

transformers 5 writes one `rope_parameters` entry per layer type: the full layers' is
`rope_theta` (+ `rope_scaling`), the sliding layers' `local_rope_theta`. YaRN, which the
long-context OLMo 3 releases set on their full layers, is refused at import.

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 4, "sliding_window": 6}, "config.json")
  >>> fields["layer_types"], fields["local_rope_theta"]
  (('sliding', 'sliding', 'sliding', 'full'), 500000.0)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import (
    HFFamily, read_layer_types, write_layer_types)
from jax_ai_stack.recipes.models.hf.families.olmo2 import NORMS, SWITCHES, read_olmo

DEFAULT_THETA = 500_000.0
"""transformers' Olmo3Config.default_theta: each layer type's RoPE base when none is written."""


def _read(hf, source):
  default = ["sliding_attention" if (i + 1) % 4 else "full_attention"
             for i in range(hf.get("num_hidden_layers", 0))]
  rope = hf.get("rope_parameters") or {}
  local = hf.get("rope_theta", DEFAULT_THETA)
  if isinstance(rope.get("sliding_attention"), dict):
    local = rope["sliding_attention"].get("rope_theta", local)
  return {**read_olmo(hf, source), **read_layer_types(hf, source, default),
          "local_rope_theta": float(local)}


def _write(config):
  from jax_ai_stack.recipes.models.hf.config_json import hf_rope_scaling

  full = {"rope_type": "default", **(hf_rope_scaling(config) or {}),
          "rope_theta": config.rope_theta}
  sliding = {"rope_type": "default", "rope_theta": config.local_rope_theta or config.rope_theta}
  return {"attention_bias": False, "sliding_window": config.sliding_window,
          "layer_types": write_layer_types(config), "rope_scaling": None,
          "rope_parameters": {"full_attention": full, "sliding_attention": sliding}}


FAMILY = HFFamily("Olmo3ForCausalLM", "olmo3", "olmo3",
                  keys=("attention_bias", "sliding_window", "layer_types"), read=_read,
                  write=_write, norms=NORMS, switches=SWITCHES,
                  free=("layer_types", "sliding_window", "local_rope_theta"))
