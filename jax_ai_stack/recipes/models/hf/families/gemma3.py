"""Gemma 3, text (`Gemma3ForCausalLM`, and the text half of `Gemma3ForConditionalGeneration`):
Gemma 2 plus q/k norms, 5 local : 1 global layers, a RoPE base of their own for the
local layers (`rope_local_base_freq`) and `rope_theta` (+ scaling) for the global ones.

A conditional-generation checkpoint is read from its `text_config` and its
`language_model` tensors (`config_json`, `reader`); export writes the text model.

Example:
  >>> fields = FAMILY.read({"num_hidden_layers": 6, "sliding_window": 512,
  ...                       "rope_local_base_freq": 10000.0}, "config.json")
  >>> fields["layer_types"], fields["local_rope_theta"]
  (('sliding', 'sliding', 'sliding', 'sliding', 'sliding', 'full'), 10000.0)
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily
from jax_ai_stack.recipes.models.hf.families.gemma2 import (FREE, KEYS, NORMS, SWITCHES, read_gemma,
                                                           write_gemma)


def _read(hf, source):
  pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
  default = ["sliding_attention" if (i + 1) % pattern else "full_attention"
             for i in range(hf.get("num_hidden_layers", 0))]
  local = hf.get("rope_local_base_freq", 10_000.0)
  rope = hf.get("rope_parameters") or {}
  if isinstance(rope.get("sliding_attention"), dict):  # transformers 5: one entry per layer type.
    local = rope["sliding_attention"].get("rope_theta", local)
  return {**read_gemma(hf, source, default), "local_rope_theta": float(local)}


def _write(config):
  return {**write_gemma(config), "rope_local_base_freq": config.local_rope_theta or
          config.rope_theta}


FAMILY = HFFamily("Gemma3ForCausalLM", "gemma3_text", "gemma3",
                  keys=(*KEYS, "rope_local_base_freq", "sliding_window_pattern",
                        "_sliding_window_pattern"),
                  read=_read, write=_write, activation_key="hidden_activation",
                  activation="gelu_pytorch_tanh", norms=NORMS,
                  switches={**SWITCHES, "qk_norm": True}, free=(*FREE, "local_rope_theta"),
                  ties_embeddings=True)
