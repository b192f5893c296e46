"""The Hugging Face decoder architectures, one small module each: what differs from Llama.

A family module holds one `HFFamily`: its architecture and `model_type`, the
config.json keys it reads beyond the shared ones (`config_json.SHARED_KEYS`)
and how they map onto `DecoderConfig`'s switches, what it writes back, and its
tensor names where they differ from Llama's. `config_json` and `layout` do the
shared work; a family is found by its architecture name (`for_architecture`) or
by the `DecoderConfig.kind` it builds (`for_kind`), and its module loads then.

Example:
  >>> for_architecture("Qwen3ForCausalLM").kind
  'qwen3'
  >>> for_kind("gemma2").norms["post_mlp_norm"]
  'post_feedforward_layernorm'
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jax_ai_stack.errors import ModelFileError
from jax_ai_stack.lazy import lazy_attributes

LLAMA_NORMS: Mapping[str, str] = {"attention_norm": "input_layernorm",
                                  "mlp_norm": "post_attention_layernorm"}
"""Our norm attributes of a block -> their Hugging Face names, Llama's two."""


def refuse(source: str, field: str, value: Any, why: str) -> ModelFileError:
  """The one-line error of a config.json field this package cannot represent."""
  return ModelFileError(f"{source}: {field}={value!r} is not supported: {why}")


def _nothing(*_) -> dict[str, Any]:
  return {}


@dataclasses.dataclass(frozen=True)
class Experts:
  """Where a mixture-of-experts family keeps a sparse layer's tensors, under `layers.{i}.`."""

  block: str
  """The MoE block's attribute: `block_sparse_moe` (Mixtral), `mlp` (Qwen3-MoE)."""
  router: str
  """The router's attribute in the block (`<block>.<router>.weight`, [E, d_model])."""
  weights: Mapping[str, str]
  """Our expert weights -> their names (`<block>.experts.{j}.<name>.weight`)."""
  shared_expert: str | None = None
  """A shared expert's attribute in the block (a dense MLP: `<block>.<name>.gate_proj...`,
  Qwen2-MoE's `shared_expert`); None: no shared expert."""
  shared_expert_gate: str | None = None
  """Its gate's attribute (`<block>.<name>.weight`, [1, d_model]); None: ungated."""
  stacked: bool = False
  """Each of `weights` is one tensor `<block>.experts.<name>` of every expert, [E, ...] in
  our layout (GPT-OSS's), not one `<block>.experts.{j}.<name>.weight` per expert."""
  fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  """Stacked (`stacked`) weights it stores as one tensor, `<block>.experts.<name>` -> ours,
  concatenated along the last axis (Llama 4's `gate_up_proj` [E, d, 2f]: the gate, then the
  up): split on import, so that the model's experts are the plain gated ones."""
  moe: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """The `MoeConfig` fields of its layout (`MOE_LAYOUT`) that are not their defaults; a
  model.moe with others cannot be written as this family."""
  correction_bias: str | None = None
  """The router's choice-only bias (`MoeConfig.score_correction`), `<block>.<router>.<name>`
  [E] (DeepSeek-V3's `e_score_correction_bias`)."""
  routing: tuple[str, ...] = ()
  """`MOE_LAYOUT` fields its config.json states, so that any value of them can be written
  (DeepSeek-V3's group-limited routing)."""


MOE_LAYOUT = {"router_bias": False, "expert_bias": False, "interleaved_gate_up": False,
              "expert_activation": "gated", "router_score": "softmax", "weight_inputs": False,
              "score_correction": False, "router_groups": 1, "router_topk_groups": 1,
              "routed_scale": 1.0}
"""The `MoeConfig` fields a family's layout fixes (its tensors, or what its config.json cannot
state), and their defaults."""


@dataclasses.dataclass(frozen=True)
class HFFamily:
  """One Hugging Face architecture as the decoder sees it."""

  architecture: str
  """config.json's `architectures` entry, e.g. "Qwen3ForCausalLM" (the one export writes)."""
  model_type: str
  """config.json's `model_type`."""
  kind: str
  """The `DecoderConfig.kind` it builds."""
  keys: tuple[str, ...] = ()
  """config.json keys it reads beyond the shared ones (others are refused by name)."""
  read: Callable[[Mapping[str, Any], str], dict[str, Any]] = _nothing
  """(config.json, its path) -> the `DecoderConfig` switches it sets."""
  write: Callable[[Any], dict[str, Any]] = _nothing
  """DecoderConfig -> the config.json entries beyond the shared ones."""
  activation_key: str = "hidden_act"
  """The config.json key of the MLP's activation."""
  activation: str = "silu"
  """That activation (the one `DecoderConfig.mlp_activation` of this kind computes)."""
  norms: Mapping[str, str] = dataclasses.field(default_factory=lambda: LLAMA_NORMS)
  """Our norm attributes of a block -> their Hugging Face names."""
  experts: Experts | None = None
  """A mixture-of-experts family's tensor names; None: dense MLPs only (`DecoderConfig.moe`
  is set exactly for the kinds with experts)."""
  switches: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """The `DecoderConfig` switches this architecture has on: a config of its `kind` that does
  not name them gets these values, and may not set them otherwise."""
  free: tuple[str, ...] = ()
  """The switches its users may set as they like; the others keep their defaults (or
  `switches`), since its Hugging Face layout cannot express them."""
  ties_embeddings: bool = False
  """Whether a config.json without `tie_word_embeddings` ties the head to the embedding."""
  fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  """Weights it stores as one tensor -> Llama's tensors it is made of, names within a layer
  (`self_attn.qkv_proj` -> q_proj, k_proj, v_proj: Phi-3's), concatenated along torch's out
  dimension: split on import, fused again on export (`layout.tensors`)."""
  mlp: str = "mlp"
  """The dense MLP's attribute in a layer (`layers.{i}.<mlp>.gate_proj...`; Llama 4's
  `feed_forward`)."""
  linear_attention: bool = False
  """Its layers may be gated DeltaNet ("linear" in `DecoderConfig.layer_types`, which then
  needs `linear_attention`): Qwen3-Next's tensors (`layout.tensors`)."""
  latent_attention: bool = False
  """Its attention is multi-head latent attention (`DecoderConfig.latent_attention`, which
  its kind then needs): DeepSeek-V3's tensors (`layout.tensors`)."""
  prediction_layers: bool = False
  """Its checkpoints may hold multi-token prediction layers after the decoder's
  (`layers.{num_hidden_layers}.*`, DeepSeek-V3's), which are not read (`reader.unread_layers`)."""
  interleaved_rope: bool = False
  """Its RoPE turns features (2i, 2i + 1) of each head together (complex pairs: Llama 4's),
  not ours (i, i + H/2): q_proj's and k_proj's rows are reordered on import, and back on
  export (`layout.Tensor.rope_pairs`), which changes no logit."""


_MODULES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
            "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Gemma3ForConditionalGeneration": "gemma3", "MixtralForCausalLM": "mixtral",
            "Qwen3MoeForCausalLM": "qwen3_moe", "Olmo2ForCausalLM": "olmo2",
            "Olmo3ForCausalLM": "olmo3", "SmolLM3ForCausalLM": "smollm3",
            "Phi3ForCausalLM": "phi3", "Qwen2MoeForCausalLM": "qwen2_moe",
            "GptOssForCausalLM": "gpt_oss", "Llama4ForCausalLM": "llama4",
            "Llama4ForConditionalGeneration": "llama4", "DeepseekV3ForCausalLM": "deepseek_v3",
            "Qwen3NextForCausalLM": "qwen3_next"}
"""Architecture name -> the module (in this package) of its family: the one list of them."""

ARCHITECTURES = tuple(_MODULES)
"""Every architecture `for_architecture` knows."""

KINDS = tuple(dict.fromkeys(_MODULES.values()))
"""Every `DecoderConfig.kind`, in the order written above (each module is named for its kind)."""


def _load(module: str) -> HFFamily:
  return importlib.import_module(f"{__name__}.{module}").FAMILY


def for_architecture(architecture: str) -> HFFamily | None:
  """The family that reads `architecture`; None for one this package does not read."""
  module = _MODULES.get(architecture)
  return None if module is None else _load(module)


def for_kind(kind: str) -> HFFamily:
  """The family of a `DecoderConfig.kind` (whose layout export writes)."""
  return _load(kind)


def every_family() -> tuple[HFFamily, ...]:
  """Each kind's family, in `KINDS`' order (the config tables are built from them)."""
  return tuple(_load(kind) for kind in KINDS)


_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def read_layer_types(hf: Mapping[str, Any], source: str,
                     default: list[str] | None = None) -> dict[str, Any]:
  """`layer_types` and `sliding_window` from config.json's (transformers 5 writes the
  list; older files imply it: `default`). Without a window every layer is full."""
  window = hf.get("sliding_window")
  names = hf.get("layer_types") or default
  if window is None or names is None:
    return dict(layer_types=None, sliding_window=None)
  unknown = [name for name in names if name not in _LAYER_TYPES]
  if unknown or len(names) != hf.get("num_hidden_layers"):
    raise refuse(source, "layer_types", list(names), "expected one of " + " or ".join(
        _LAYER_TYPES) + " per layer")
  types = tuple(_LAYER_TYPES[name] for name in names)
  if "sliding" not in types:
    return dict(layer_types=None, sliding_window=None)
  return dict(layer_types=types, sliding_window=window)


def read_rope_flags(hf: Mapping[str, Any], source: str, *, one_per_layer: bool) -> list[int]:
  """`no_rope_layers` of config.json: a 1 (RoPE) or 0 (NoPE) per layer; without it every
  `no_rope_layer_interval`-th layer (default 4) is NoPE, as SmolLM3 and Llama 4 have it.
  `one_per_layer`: exactly one flag per layer (else at least one)."""
  layers = hf.get("num_hidden_layers", 0)
  interval = hf.get("no_rope_layer_interval", 4)
  flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
  short = len(flags) != layers if one_per_layer else len(flags) < layers
  if short or any(flag not in (0, 1) for flag in flags):
    raise refuse(source, "no_rope_layers", flags, "expected a 1 (RoPE) or 0 (NoPE) per layer")
  return flags


def write_layer_types(config: Any) -> list[str]:
  """config.json's `layer_types` of a `DecoderConfig`."""
  back = {ours: theirs for theirs, ours in _LAYER_TYPES.items()}
  return [back[t] for t in config.resolved_layer_types]


__getattr__, __dir__ = lazy_attributes(__name__, KINDS, {})
