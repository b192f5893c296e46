"""A Hugging Face decoder's config.json <-> `DecoderConfig`: read (refusing by key) and written.

Example:
  >>> fields = llama_fields({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
  ...     "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
  ...     "vocab_size": 300})
  >>> DecoderConfig(**fields).num_kv_heads, fields["norm_eps"]
  (4, 1e-06)
  >>> hf_config(DecoderConfig(**fields), bos_token_id=1)["num_key_value_heads"]
  4
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from jax_ai_stack.errors import ConfigError, ModelFileError
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.models.configs import DecoderConfig
from jax_ai_stack.recipes.models.hf import families
from jax_ai_stack.recipes.models.hf.families import refuse
from jax_ai_stack.recipes.models.hf.layout import CONFIG_FILE

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
SHARED_KEYS = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "torch_dtype", "dtype",
    "rope_theta", "rope_scaling", "rope_parameters", "hidden_act", "attention_dropout",
})
"""The config.json keys every family reads (its own add `HFFamily.keys`)."""

IGNORED_KEYS = frozenset({
    # Token ids, initialisation, caching and bookkeeping: no effect on the logits.
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "transformers_version", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "is_decoder", "add_cross_attention", "tie_encoder_decoder", "_attn_implementation_autoset",
    "finetuning_task", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "cross_attention_hidden_size", "bad_words_ids", "begin_suppress_tokens",
    "forced_bos_token_id", "forced_eos_token_id", "suppress_tokens", "max_length", "min_length",
    "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "remove_invalid_values",
    "exponential_decay_length_penalty",
})
"""Generic config.json keys (transformers' PretrainedConfig) that change no logit."""

_CONDITIONAL_KEYS = frozenset({
    "text_config", "vision_config", "mm_tokens_per_image", "boi_token_index", "eoi_token_index",
    "image_token_index", "initializer_range",
})
"""Top-level keys of a conditional-generation (text + vision) config.json: the text
model is read from `text_config`, the vision tower is not read."""


def decoder_fields(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> dict[str, Any]:
  """The `DecoderConfig` fields a Hugging Face config.json describes.

  The architecture picks the family (`families`); missing optional fields take
  transformers' defaults; the compute and parameter dtypes both become
  `torch_dtype` (float32 if absent).

  Raises:
    ModelFileError: naming the config.json key or value this model cannot
      represent, or an architecture no family reads (listing those that are read).
  """
  architectures = list(hf.get("architectures") or ["LlamaForCausalLM"])
  family = families.for_architecture(architectures[0]) if len(architectures) == 1 else None
  if family is None:
    raise refuse(source, "architectures", architectures,
                 "supported: " + ", ".join(families.ARCHITECTURES))
  if architectures[0] != family.architecture:  # A text + vision checkpoint: its text model.
    unknown = sorted(set(hf) - _CONDITIONAL_KEYS - IGNORED_KEYS - {"architectures", "model_type",
                                                                   "tie_word_embeddings",
                                                                   "torch_dtype", "dtype"})
    if unknown:
      raise refuse(source, unknown[0], hf[unknown[0]], f"not a key of {architectures[0]}")
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
      raise ModelFileError(f"{source}: {architectures[0]} needs a text_config object")
    inherited = {k: hf[k] for k in ("tie_word_embeddings", "torch_dtype", "dtype") if k in hf}
    hf = {**inherited, **text, "architectures": [family.architecture]}
    source = f"{source} text_config"
  if hf.get("model_type", family.model_type) != family.model_type:
    raise refuse(source, "model_type", hf["model_type"],
                 f"{family.architecture} has {family.model_type!r}")
  known = SHARED_KEYS | IGNORED_KEYS | set(family.keys) | {family.activation_key}
  if unknown := sorted(set(hf) - known):
    raise refuse(source, unknown[0], hf[unknown[0]],
                 f"{family.architecture}'s reader does not know this key, so it cannot tell "
                 "whether it changes the model")
  return {**_shared_fields(hf, source, family), **family.read(hf, source)}


def _shared_fields(hf: Mapping[str, Any], source: str, family) -> dict[str, Any]:
  """The shape, RoPE and numerics keys every family reads alike."""
  act = hf.get(family.activation_key, hf.get("hidden_act", family.activation))
  if act != family.activation:
    raise refuse(source, family.activation_key, act,
                 f"{family.architecture}'s gated MLP uses {family.activation}")
  rope_field, rope = _rope_parameters(hf, source)
  if hf.get("attention_dropout", 0.0):
    raise refuse(source, "attention_dropout", hf["attention_dropout"], "the model has no dropout")
  dtype_field = "torch_dtype" if "torch_dtype" in hf else "dtype"  # transformers 5: "dtype".
  dtype = hf.get(dtype_field) or "float32"
  if dtype not in _DTYPES:
    raise refuse(source, dtype_field, dtype, f"use one of {', '.join(_DTYPES)}")
  required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
              "vocab_size")
  missing = [field for field in required if field not in hf]
  if missing:
    raise ModelFileError(f"{source}: missing {', '.join(missing)}")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim")
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial != 1.0 and "rotary_dim" not in family.free:
    raise refuse(source, "partial_rotary_factor", partial, f"{family.architecture} turns every "
                 "feature of a head by RoPE")
  return dict(
      kind=family.kind,
      vocab_size=hf["vocab_size"],
      num_layers=hf["num_hidden_layers"],
      d_model=hf["hidden_size"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=None if head_dim in (None, hf["hidden_size"] // heads) else head_dim,
      **({} if partial == 1.0 else  # transformers' int(): the first rotary_dim features turn.
         {"rotary_dim": int((head_dim or hf["hidden_size"] // heads) * partial)}),
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
      rope_scaling=_rope_scaling(hf, rope_field, rope, source),
      max_seq_len=hf.get("max_position_embeddings", 2048),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", family.ties_embeddings)),
      dtype=_DTYPES[dtype],
      param_dtype=_DTYPES[dtype],
  )


llama_fields = decoder_fields
"""`decoder_fields` under its first name, from when Llama was the one architecture."""


_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
_YARN_UNREAD = ("partial_rotary_factor",)
"""YaRN keys that are refused where set."""
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_parameters(hf: Mapping[str, Any], source: str) -> tuple[str, Mapping[str, Any]]:
  """The config.json field that holds the (full layers') RoPE parameters, and its value.

  transformers 4 writes `rope_scaling` (beside a top-level rope_theta),
  transformers 5 `rope_parameters` (rope_theta inside; Gemma 3's one entry per
  layer type, of which the full layers' is this one); like transformers 5, a
  non-empty `rope_scaling` wins.
  """
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rope = hf.get(field) or {}
  if not isinstance(rope, Mapping):
    raise refuse(source, field, rope, "expected an object")
  if isinstance(rope.get("full_attention"), Mapping):
    sliding = rope.get("sliding_attention") or {}
    if sliding.get("rope_type", "default") != "default":
      raise refuse(source, f"{field}.sliding_attention", dict(sliding),
                   "the local layers' RoPE is plain (rope_type default)")
    field, rope = f"{field}.full_attention", rope["full_attention"]
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in _ROPE_TYPES:
    raise refuse(source, field, dict(rope), f"of the RoPE types only {', '.join(_ROPE_TYPES)} "
                 "are implemented")
  return field, rope


def _rope_scaling(hf: Mapping[str, Any], field: str, rope: Mapping[str, Any],
                  source: str) -> dict[str, Any] | None:
  """`DecoderConfig.rope_scaling` of a "llama3" or "linear" rope; None for plain RoPE.

  A missing original_max_position_embeddings is max_position_embeddings, as
  in transformers.
  """
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind == "default":
    return None
  if kind == "longrope":
    return _longrope(hf, field, rope, source)
  if kind == "yarn":
    return _yarn(hf, field, rope, source)
  if kind == "linear":
    if rope.get("factor") is None:
      raise ModelFileError(f"{source}: {field} of rope_type 'linear' has no factor")
    return dict(kind="linear", factor=rope["factor"])
  missing = [name for name in _LLAMA3_FIELDS if rope.get(name) is None]
  if missing:
    raise ModelFileError(f"{source}: {field} of rope_type 'llama3' has no {', '.join(missing)}")
  original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
  return dict(kind="llama3", **{name: rope[name] for name in _LLAMA3_FIELDS},
              original_max_position_embeddings=original)


def _longrope(hf: Mapping[str, Any], field: str, rope: Mapping[str, Any],
              source: str) -> dict[str, Any]:
  """`DecoderConfig.rope_scaling` of a "longrope" rope, as transformers 5.24.0 reads it:
  Phi-3's top-level original_max_position_embeddings first; without `factor`, the ratio of
  max_position_embeddings to it; without `attention_factor`, sqrt(1 + ln factor / ln it)."""
  missing = [name for name in ("short_factor", "long_factor") if not rope.get(name)]
  if missing:
    raise ModelFileError(f"{source}: {field} of rope_type 'longrope' has no {', '.join(missing)}")
  longest = hf.get("max_position_embeddings", 2048)
  original = (hf.get("original_max_position_embeddings")
              or rope.get("original_max_position_embeddings") or longest)
  factor = rope.get("factor") or longest / original
  attention = rope.get("attention_factor")
  if attention is None:
    attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
  return dict(kind="longrope", factor=float(factor), original_max_position_embeddings=original,
              short_factor=tuple(float(x) for x in rope["short_factor"]),
              long_factor=tuple(float(x) for x in rope["long_factor"]),
              attention_factor=float(attention))


def _yarn(hf: Mapping[str, Any], field: str, rope: Mapping[str, Any],
          source: str) -> dict[str, Any]:
  """YaRN's `RopeScaling`, with transformers' defaults (beta_fast 32, beta_slow 1, truncate)."""
  for key in _YARN_UNREAD:
    value = rope.get(key)
    if value and not (key == "partial_rotary_factor" and value == 1.0):
      raise refuse(source, f"{field}.{key}", value, "YaRN is implemented without it")
  if rope.get("factor") is None:
    raise ModelFileError(f"{source}: {field} of rope_type 'yarn' has no factor")
  original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings",
                                                                     2048)
  return dict(kind="yarn", factor=rope["factor"], beta_fast=rope.get("beta_fast") or 32.0,
              beta_slow=rope.get("beta_slow") or 1.0, truncate=bool(rope.get("truncate", True)),
              attention_factor=rope.get("attention_factor"),
              mscale=rope.get("mscale") or None, mscale_all_dim=rope.get("mscale_all_dim") or None,
              original_max_position_embeddings=original)


def read_config(directory: str | os.PathLike) -> dict[str, Any]:
  """`llama_fields` of `directory`'s config.json; ModelFileError if unreadable."""
  path = pathlib.Path(directory) / CONFIG_FILE
  if not pathlib.Path(directory).is_dir():
    raise ModelFileError(f"{directory}: not a directory (a Hugging Face model directory)")
  if not path.is_file():
    raise ModelFileError(f"{directory}: no {CONFIG_FILE}; not a Hugging Face model directory")
  try:
    hf = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as e:
    raise ModelFileError(f"{path}: not readable JSON: {e}") from None
  if not isinstance(hf, dict):
    raise ModelFileError(f"{path}: the top level must be an object")
  fields = decoder_fields(hf, str(path))
  try:  # configlib's message is one line naming the field.
    configlib.from_dict(DecoderConfig, fields, source=f"{path}: does not describe a valid model")
  except ConfigError as e:
    raise ModelFileError(str(e)) from None
  return fields


def hf_config(config: DecoderConfig, **token_ids: int) -> dict[str, Any]:
  """The config.json of `config` (its kind's architecture), plus e.g. bos_token_id=..."""
  family = families.for_kind(config.kind)
  return {
      "architectures": [family.architecture],
      "model_type": family.model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.resolved_head_dim,
      family.activation_key: family.activation,
      "max_position_embeddings": config.max_seq_len,
      "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": hf_rope_scaling(config),
      "attention_dropout": 0.0,
      **family.write(config),
      "tie_word_embeddings": config.tie_embeddings,
      "torch_dtype": config.param_dtype,
      "initializer_range": 0.02,
      "use_cache": True,
      **token_ids,
  }


def hf_rope_scaling(config: DecoderConfig) -> dict[str, Any] | None:
  """config.json's `rope_scaling`, as Meta's Llama 3.1 / 3.2 (or Gemma 3's) files write it."""
  scaling = config.rope_scaling
  if scaling is None:
    return None
  if scaling.kind == "linear":
    return {"rope_type": "linear", "factor": scaling.factor}
  if scaling.kind == "longrope":
    return {"rope_type": "longrope", "short_factor": list(scaling.short_factor),
            "long_factor": list(scaling.long_factor), "factor": scaling.factor,
            "attention_factor": scaling.attention_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
  if scaling.kind == "yarn":
    yarn = {"rope_type": "yarn", "factor": scaling.factor, "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow, "truncate": scaling.truncate,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
    if scaling.attention_factor is not None:
      yarn["attention_factor"] = scaling.attention_factor
    for key in ("mscale", "mscale_all_dim"):
      if getattr(scaling, key) is not None:
        yarn[key] = getattr(scaling, key)
    return yarn
  return {
      "rope_type": scaling.kind,
      "factor": scaling.factor,
      "low_freq_factor": scaling.low_freq_factor,
      "high_freq_factor": scaling.high_freq_factor,
      "original_max_position_embeddings": scaling.original_max_position_embeddings,
  }
