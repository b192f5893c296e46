"""Hugging Face Llama checkpoints in and out of the NNX `Decoder`: config.json + safetensors.

A Hugging Face directory holds `config.json` and the weights, either one
`model.safetensors` or shards `model-0000i-of-0000n.safetensors` listed in
`model.safetensors.index.json`. `read_config` maps config.json onto a
`DecoderConfig` (refusing, by field name, what this model cannot represent),
`load_params` reads the weights into the model's parameters and `save` writes
them back in the same layout, with a config.json that
`transformers.LlamaForCausalLM.from_pretrained` loads.

The layouts differ in three ways, all handled by `TENSORS`:

* torch's `Linear.weight` is [out, in]; our kernels are [in, out], and the
  attention projections keep heads as their own axes ([D, N, H], [N, H, D]).
* The names: `model.layers.3.self_attn.q_proj.weight` is
  `layers/3/attention/q_proj/kernel`.
* RoPE needs none: Hugging Face stores q and k for the "rotate half"
  convention (Meta's conversion script permutes them into it), pairing
  features (i, i + H/2) with inv_freq = 1 / theta^(2i / H), which is exactly
  `decoder.apply_rope`. tests/test_hf.py checks it against a NumPy forward pass
  written from Hugging Face's code, and that the permuted (interleaved) layout
  fails that check. Llama 3.1 / 3.2's `rope_scaling` ("llama3"), Gemma 3's
  ("linear") and Phi-3's ("longrope") map onto `DecoderConfig.rope_scaling`; the
  other RoPE types (YaRN, dynamic) are refused.

Loading is lazy: one tensor at a time is read from disk (`safe_open`), cast to
the parameter dtype and placed straight onto its sharding, so no full host
copy of the model ever exists; each process reads only the tensors, and hands
each device only its part.

One job per module: `layout` (the directory's files; each tensor's name and
layout, shared by both directions), `config_json` (config.json <->
`DecoderConfig`), `reader` (checking and loading weights), `special_tokens` (the
tokenizer's ids and generation config, kept and written back) and `writer` (`save`).
The names below load from them on first use, so importing the package pays
for no jax.

Example:
  >>> from jax_ai_stack.recipes.models import hf
  >>> from jax_ai_stack.recipes.models.configs import DecoderConfig
  >>> fields = hf.llama_fields({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
  ...     "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
  ...     "vocab_size": 300})
  >>> DecoderConfig(**fields).num_kv_heads, fields["norm_eps"]
  (4, 1e-06)
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("config_json", "families", "layout", "reader", "special_tokens", "writer")
_EXPORTS = {
    "hf_config": "config_json", "llama_fields": "config_json", "read_config": "config_json",
    "decoder_fields": "config_json",
    "CONFIG_FILE": "layout", "INDEX_FILE": "layout", "TOKENIZER_FILE": "layout",
    "TOKENIZER_COMPANIONS": "layout", "copy_tokenizer": "layout",
    "WEIGHTS_FILE": "layout", "Tensor": "layout", "tensors": "layout",
    "PROGRESS_MIN_BYTES": "reader", "Stored": "reader", "check_weights": "reader",
    "load_model": "reader", "load_params": "reader", "read_index": "reader",
    "unread_layers": "reader",
    "DEFAULT_MAX_SHARD_BYTES": "writer", "save": "writer", "writes": "writer",
}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
