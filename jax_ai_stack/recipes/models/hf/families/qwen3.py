"""Qwen3 (`Qwen3ForCausalLM`): Qwen2's sliding layers, q/k RMSNorms, biases only if asked.

Example:
  >>> FAMILY.read({"attention_bias": True}, "config.json")["qkv_bias"]
  True
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily
from jax_ai_stack.recipes.models.hf.families.qwen2 import SLIDING_KEYS, read_sliding, write_sliding


def _read(hf, source):
  return {"qkv_bias": bool(hf.get("attention_bias", False)), **read_sliding(hf, source)}


def _write(config):
  return {"attention_bias": config.qkv_bias, **write_sliding(config)}


FAMILY = HFFamily("Qwen3ForCausalLM", "qwen3", "qwen3", keys=("attention_bias", *SLIDING_KEYS),
                  read=_read, write=_write, switches=dict(qk_norm=True),
                  free=("qkv_bias", "layer_types", "sliding_window"))
