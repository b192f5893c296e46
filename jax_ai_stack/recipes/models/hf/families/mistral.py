"""Mistral (`MistralForCausalLM`): Decoder with `sliding_window` on every layer (or none).

Example:
  >>> FAMILY.read({"sliding_window": 4096}, "config.json")
  {'sliding_window': 4096}
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily


def _read(hf, source):
  del source
  return {"sliding_window": hf.get("sliding_window")}


def _write(config):
  return {"sliding_window": config.sliding_window}


FAMILY = HFFamily("MistralForCausalLM", "mistral", "mistral", keys=("sliding_window",),
                  read=_read, write=_write, free=("sliding_window",))
