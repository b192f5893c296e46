"""OLMo 2 (`Olmo2ForCausalLM`): Llama with norms after each sublayer instead of before it, and
q/k RMSNorms over the whole projection (every head's features at once).

The block is x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(mlp(x)):
no input norms (`pre_norms` off, `post_norms` on); q_norm / k_norm weigh heads x head_dim
features (`qk_norm_scope` "projection"). Biases (`attention_bias`, which OLMo's o_proj
would carry too) are refused.

Example:
  >>> FAMILY.read({"attention_bias": False}, "config.json")
  {}
  >>> FAMILY.norms["post_mlp_norm"]
  'post_feedforward_layernorm'
"""

from __future__ import annotations

from jax_ai_stack.recipes.models.hf.families import HFFamily, refuse

NORMS = {"post_attention_norm": "post_attention_layernorm",
         "post_mlp_norm": "post_feedforward_layernorm"}
SWITCHES = dict(pre_norms=False, post_norms=True, qk_norm=True, qk_norm_scope="projection")


def read_olmo(hf, source):
  """What OLMo 2 and 3 refuse alike."""
  if hf.get("attention_bias"):
    raise refuse(source, "attention_bias", hf["attention_bias"], "the model has no biases")
  return {}


def _write(config):
  del config
  return {"attention_bias": False}


FAMILY = HFFamily("Olmo2ForCausalLM", "olmo2", "olmo2", keys=("attention_bias",), read=read_olmo,
                  write=_write, norms=NORMS, switches=SWITCHES)
