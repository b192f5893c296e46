"""Phi-3 / Phi-4 (`Phi3ForCausalLM`): Mistral's layout with q, k and v in one `qkv_proj` and
the MLP's gate and up in one `gate_up_proj` (split on import, fused again on export), and
LongRoPE (`rope_scaling` of type "longrope": `RopeScaling.short_factor` / `long_factor`).

A `sliding_window` applies to every layer; `partial_rotary_factor` below 1 (Phi-4-mini's
0.75) turns only the first `rotary_dim` features of each head. Dropout (`resid_pdrop`,
`embd_pdrop`) is refused at import.

Example:
  >>> FAMILY.read({"sliding_window": 2047, "resid_pdrop": 0.0}, "config.json")
  {'sliding_window': 2047}
  >>> FAMILY.fused["mlp.gate_up_proj"]
  ('mlp.gate_proj', 'mlp.up_proj')
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily, refuse

KEYS = ("sliding_window", "original_max_position_embeddings", "resid_pdrop", "embd_pdrop",
        "partial_rotary_factor")
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _read(hf, source):
  for field in ("resid_pdrop", "embd_pdrop"):
    if hf.get(field):
      raise refuse(source, field, hf[field], "the model has no dropout")
  return {"sliding_window": hf.get("sliding_window")}


def _write(config):
  scaling = config.rope_scaling
  original = (scaling.original_max_position_embeddings
              if scaling is not None and scaling.kind == "longrope" else config.max_seq_len)
  rotary = (config.rotary_dim or config.resolved_head_dim) / config.resolved_head_dim
  return {"sliding_window": config.sliding_window, "original_max_position_embeddings": original,
          "partial_rotary_factor": rotary, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
          "pad_token_id": None}  # Not transformers' default, past a small vocabulary (an
  # nn.Embedding's padding_idx); export-hf's token ids replace it.


FAMILY = HFFamily("Phi3ForCausalLM", "phi3", "phi3", keys=KEYS, read=_read, write=_write,
                  free=("sliding_window", "rotary_dim"), fused=FUSED)
