"""A Hugging Face Llama config.json <-> `LlamaConfig`: read (refusing by field name) and written.

Example:
  >>> fields = llama_fields({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
  ...     "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
  ...     "vocab_size": 300})
  >>> LlamaConfig(**fields).num_kv_heads, fields["norm_eps"]
  (4, 1e-06)
  >>> hf_config(LlamaConfig(**fields), bos_token_id=1)["num_key_value_heads"]
  4
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from jax_ai_stack.errors import ConfigError, ModelFileError
from jax_ai_stack.recipes import configlib
from jax_ai_stack.recipes.models.configs import LlamaConfig
from jax_ai_stack.recipes.models.hf.layout import CONFIG_FILE

_MODEL_TYPE = "llama"
"""config.json's `model_type` of the one architecture this module reads and writes."""

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _refuse(source: str, field: str, value: Any, why: str) -> ModelFileError:
  return ModelFileError(f"{source}: {field}={value!r} is not supported: {why}")


def llama_fields(hf: Mapping[str, Any], source: str = CONFIG_FILE) -> dict[str, Any]:
  """The `LlamaConfig` fields a Hugging Face Llama config.json describes.

  Missing optional fields take `transformers.LlamaConfig`'s defaults; the
  compute and parameter dtypes both become `torch_dtype` (float32 if absent).

  Raises:
    ModelFileError: naming the config.json field this model cannot represent.
  """
  architectures = hf.get("architectures") or ["LlamaForCausalLM"]
  if list(architectures) != ["LlamaForCausalLM"]:
    raise _refuse(source, "architectures", architectures, "only LlamaForCausalLM is")
  if hf.get("model_type", _MODEL_TYPE) != _MODEL_TYPE:
    raise _refuse(source, "model_type", hf["model_type"], f"only {_MODEL_TYPE!r} is")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise _refuse(source, "hidden_act", act, "the MLP is SwiGLU (silu)")
  rope_field, rope = _rope_parameters(hf, source)
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      raise _refuse(source, field, hf[field], "the model has no biases")
  if hf.get("sliding_window") is not None:
    raise _refuse(source, "sliding_window", hf["sliding_window"], "attention is full causal")
  if hf.get("attention_dropout", 0.0):
    raise _refuse(source, "attention_dropout", hf["attention_dropout"], "the model has no dropout")
  dtype_field = "torch_dtype" if "torch_dtype" in hf else "dtype"  # transformers 5: "dtype".
  dtype = hf.get(dtype_field) or "float32"
  if dtype not in _DTYPES:
    raise _refuse(source, dtype_field, dtype, f"use one of {', '.join(_DTYPES)}")
  required = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
              "vocab_size")
  missing = [field for field in required if field not in hf]
  if missing:
    raise ModelFileError(f"{source}: missing {', '.join(missing)}")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim")
  return dict(
      kind="llama",
      vocab_size=hf["vocab_size"],
      num_layers=hf["num_hidden_layers"],
      d_model=hf["hidden_size"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=None if head_dim in (None, hf["hidden_size"] // heads) else head_dim,
      mlp_dim=hf["intermediate_size"],
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))),
      rope_scaling=_rope_scaling(hf, rope_field, rope, source),
      max_seq_len=hf.get("max_position_embeddings", 2048),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=_DTYPES[dtype],
      param_dtype=_DTYPES[dtype],
  )


_ROPE_TYPES = ("default", "llama3")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope_parameters(hf: Mapping[str, Any], source: str) -> tuple[str, Mapping[str, Any]]:
  """The config.json field that holds the RoPE parameters, and its value.

  transformers 4 writes `rope_scaling` (beside a top-level rope_theta),
  transformers 5 `rope_parameters` (rope_theta inside); like transformers 5,
  a non-empty `rope_scaling` wins.
  """
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  rope = hf.get(field) or {}
  if not isinstance(rope, Mapping):
    raise _refuse(source, field, rope, "expected an object")
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in _ROPE_TYPES:
    raise _refuse(source, field, dict(rope), f"of the RoPE types only {' and '.join(_ROPE_TYPES)} "
                  "are implemented")
  return field, rope


def _rope_scaling(hf: Mapping[str, Any], field: str, rope: Mapping[str, Any],
                  source: str) -> dict[str, Any] | None:
  """`LlamaConfig.rope_scaling` of a "llama3" rope; None for plain RoPE.

  A missing original_max_position_embeddings is max_position_embeddings, as
  in transformers.
  """
  if rope.get("rope_type", rope.get("type", "default")) == "default":
    return None
  missing = [name for name in _LLAMA3_FIELDS if rope.get(name) is None]
  if missing:
    raise ModelFileError(f"{source}: {field} of rope_type 'llama3' has no {', '.join(missing)}")
  original = rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 2048)
  return dict(kind="llama3", **{name: rope[name] for name in _LLAMA3_FIELDS},
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
  fields = llama_fields(hf, str(path))
  try:  # configlib's message is one line naming the field.
    configlib.from_dict(LlamaConfig, fields, source=f"{path}: does not describe a valid model")
  except ConfigError as e:
    raise ModelFileError(str(e)) from None
  return fields


def hf_config(config: LlamaConfig, **token_ids: int) -> dict[str, Any]:
  """The config.json of `config` (`LlamaForCausalLM`), plus e.g. bos_token_id=..."""
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": _MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.resolved_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_seq_len,
      "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": _hf_rope_scaling(config),
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "tie_word_embeddings": config.tie_embeddings,
      "torch_dtype": config.param_dtype,
      "initializer_range": 0.02,
      "pretraining_tp": 1,
      "use_cache": True,
      **token_ids,
  }


def _hf_rope_scaling(config: LlamaConfig) -> dict[str, Any] | None:
  """config.json's `rope_scaling`, as Meta's Llama 3.1 / 3.2 files write it."""
  scaling = config.rope_scaling
  if scaling is None:
    return None
  return {
      "rope_type": scaling.kind,
      "factor": scaling.factor,
      "low_freq_factor": scaling.low_freq_factor,
      "high_freq_factor": scaling.high_freq_factor,
      "original_max_position_embeddings": scaling.original_max_position_embeddings,
  }
