"""Llama (`LlamaForCausalLM`): the shared layout itself; biases refused, `head_dim` read.

Example:
  >>> FAMILY.read({"attention_bias": False}, "config.json")
  {}
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily, refuse


def _read(hf, source):
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      raise refuse(source, field, hf[field], "the model has no biases")
  return {}


def _write(config):
  del config
  return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


FAMILY = HFFamily("LlamaForCausalLM", "llama", "llama",
                  keys=("attention_bias", "mlp_bias", "pretraining_tp"), read=_read, write=_write)
