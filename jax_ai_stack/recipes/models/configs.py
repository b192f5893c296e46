"""The model configs: the shapes and numerics of each model, and nothing that runs.

Separate from the models so that a recipe config (which holds one of these)
loads, validates and prints without importing jax or flax; `decoder` builds the
model from them. The CNN's config is `cnn_config`'s.

Example:
  >>> DecoderConfig.small().num_params()
  9589632
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

import pydantic
from pydantic import PositiveFloat, PositiveInt
from pydantic_core import ArgsKwargs

from jax_ai_stack.kernels import names
from jax_ai_stack.recipes.configlib import config_dataclass
from jax_ai_stack.recipes.models.custom_config import CustomModelConfig  # noqa: F401 - was here
from jax_ai_stack.recipes.models.hf import families as hf_families
from jax_ai_stack.recipes.models.latent_config import LatentAttentionConfig
from jax_ai_stack.recipes.models.linear_config import LinearAttentionConfig
from jax_ai_stack.recipes.models.moe_config import GroupedMatmul, MoeConfig  # noqa: F401
from jax_ai_stack.recipes.models.rope_config import RopeScaling  # noqa: F401 - was here

DECODER_PROJECTIONS = ("q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj|kv_b_proj|"
                       "in_proj_qkvz|in_proj_ba|out_proj|gate_proj|up_proj|down_proj")
"""The decoder's attention and MLP projections (latent attention's and the gated DeltaNet's
among them): the layers LoRA adapts by default."""

DType = Literal["float32", "bfloat16", "float16"]
RematPolicy = Literal["none", "full", "save_dots"]


_FAMILIES = hf_families.every_family()  # One small module each, no jax.
DecoderKind = Literal[hf_families.KINDS]  # type: ignore[valid-type]
MOE_KINDS = tuple(family.kind for family in _FAMILIES if family.experts is not None)
"""The kinds whose feed-forward layers are mixtures of experts (`DecoderConfig.moe`)."""
LATENT_KINDS = tuple(family.kind for family in _FAMILIES if family.latent_attention)
"""The kinds whose attention is multi-head latent attention (`DecoderConfig.latent_attention`)."""
LINEAR_KINDS = tuple(family.kind for family in _FAMILIES if family.linear_attention)
"""The kinds with gated DeltaNet layers ("linear" in `layer_types`)."""
LayerType = Literal["full", "sliding", "chunked", "linear"]

KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    family.kind: dict(family.switches) for family in _FAMILIES if family.switches}
"""The switches each architecture has on (its family file's `switches`): a config of that
`kind` that does not name them gets these values, and may not set them otherwise."""

KIND_FREE: dict[str, tuple[str, ...]] = {family.kind: family.free for family in _FAMILIES}
"""The switches each architecture may set as it likes (its family file's `free`); the others
keep their defaults (or `KIND_DEFAULTS`), since its Hugging Face layout cannot express them."""

SWITCHES = ("qkv_bias", "qk_norm", "qk_norm_scope", "norm_offset", "pre_norms", "post_norms",
            "embed_scale", "mlp_activation", "attn_logit_softcap", "final_logit_softcap",
            "query_pre_attn_scalar", "layer_types", "sliding_window", "local_rope_theta",
            "nope_layers", "rotary_dim", "o_proj_bias", "attention_sinks", "attention_chunk_size",
            "qk_l2_norm", "nope_temperature", "attention_output_gate")
"""The architectural switches of `DecoderConfig`, in the order its docstring lists them."""


@config_dataclass
class DecoderConfig:
  """Shapes, numerics and architectural switches of a decoder LM. The defaults are `tiny()`.

  One decoder covers Llama, Qwen2/2.5, Qwen3, Mistral, Gemma 2 and Gemma 3
  (text), Mixtral, Qwen3-MoE, Qwen2-MoE, GPT-OSS and Llama 4 (text): `kind` names the Hugging Face architecture, and each switch what it
  does; a kind fills in the switches it has on (`KIND_DEFAULTS`: `kind:
  gemma2` alone gives Gemma 2's norms, MLP and embedding scale) and refuses
  those its layout cannot express (`KIND_FREE` lists what it may vary).
  """

  kind: DecoderKind = "llama"
  """Which architecture (Hugging Face `*ForCausalLM`) this decoder is, each described by
  one file of `models/hf/families`; tells model configs apart in a recipe."""
  vocab_size: PositiveInt = 259
  """Token ids are in [0, vocab_size). 259 = 256 bytes + BOS, EOS, PAD."""
  vocab_multiple: PositiveInt = 128
  """The embedding and the output head have vocab_size rounded up to a multiple of
  this (`padded_vocab_size`): a mesh's `tensor` axis splits the vocabulary, so it
  must divide the rows, and 128 fills accelerators' matmul tiles. The padded rows'
  logits are dropped before any softmax, sample or loss, and export-hf writes
  vocab_size rows. 1: no padding (what checkpoints saved before it have)."""
  num_layers: PositiveInt = 4
  """Number of decoder blocks."""
  d_model: PositiveInt = 128
  """Width of the residual stream."""
  num_heads: PositiveInt = 4
  """Query heads per attention layer."""
  num_kv_heads: PositiveInt = 2
  """Key/value heads; must divide num_heads (== num_heads: plain multi-head)."""
  head_dim: PositiveInt | None = None
  """Features per head (even, for RoPE); None means d_model // num_heads."""
  mlp_dim: PositiveInt = 384
  """Hidden units of the gated MLP."""
  moe: MoeConfig | None = None
  """Mixture-of-experts feed-forward layers (the MoE kinds, `MOE_KINDS`: mixtral, qwen3_moe,
  qwen2_moe, gpt_oss, which need it); None: every layer's MLP is dense."""
  latent_attention: LatentAttentionConfig | None = None
  """Multi-head latent attention's shapes (the latent kinds, `LATENT_KINDS`: deepseek_v3,
  which need it); None: grouped-query attention of `num_kv_heads` x `head_dim`. With it
  `head_dim` is a query's and key's features (qk_nope_head_dim + qk_rope_head_dim)."""
  linear_attention: LinearAttentionConfig | None = None
  """The shapes of the "linear" layers of `layer_types` (gated DeltaNet: the kinds of
  `LINEAR_KINDS`, qwen3_next), which need it."""
  rope_theta: PositiveFloat = 10_000.0
  """RoPE base frequency; larger values suit longer contexts (Llama 3: 500000)."""
  rope_scaling: RopeScaling | None = None
  """Llama 3.1 / 3.2's scaling of the RoPE frequencies (Hugging Face's
  rope_scaling with rope_type "llama3"), Gemma 3's "linear" one, or GPT-OSS's "yarn",
  without which
  their weights give other logits; None is plain RoPE. import-hf sets it from
  config.json, export-hf writes it back; `model.rope_scaling.factor=32` sets it
  with Llama 3.1's other values. With `local_rope_theta` it applies to the full
  layers only."""
  max_seq_len: PositiveInt = 128
  """Longest sequence the recipes feed (training windows, prompt + generated)."""
  norm_eps: PositiveFloat = 1e-5
  """Epsilon of every RMSNorm."""
  tie_embeddings: bool = True
  """Compute logits with the embedding matrix instead of a separate head."""
  qkv_bias: bool = False
  """Biases on the q, k and v projections (Qwen2's)."""
  qk_norm: bool = False
  """An RMSNorm over each head's features of q and of k, before RoPE (Qwen3, Gemma 3)."""
  qk_norm_scope: Literal["head", "projection"] = "head"
  """What the q/k RMSNorms (`qk_norm`) normalise over: each head's features ("head"), or
  every head's at once ("projection", a weight of heads x head_dim: OLMo 2 and 3)."""
  norm_offset: float = 0.0
  """Every RMSNorm scales by (norm_offset + weight): 1.0 is Gemma's `x * (1 + w)`,
  its weight starting at 0; kept as Gemma parametrises it, not folded into the
  weight, so that a bfloat16 round trip, LoRA and weight decay see Gemma's own."""
  pre_norms: bool = True
  """RMSNorms on the attention's and the MLP's inputs; False: the sublayers read the residual
  stream as it is (OLMo 2 and 3, which norm only their outputs: `post_norms`)."""
  post_norms: bool = False
  """RMSNorms on the attention and the MLP outputs before each residual add
  (Gemma 2/3's four norms per block; OLMo 2's two, with `pre_norms` off)."""
  embed_scale: bool = False
  """Multiply the token embeddings by sqrt(d_model), in the compute dtype (Gemma's)."""
  mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
  """The gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma's)."""
  attn_logit_softcap: PositiveFloat | None = None
  """Attention logits become cap * tanh(logits / cap) (Gemma 2); None: uncapped."""
  final_logit_softcap: PositiveFloat | None = None
  """Output logits become cap * tanh(logits / cap) (Gemma 2); None: uncapped."""
  query_pre_attn_scalar: PositiveInt | None = None
  """Attention logits are scaled by query_pre_attn_scalar ** -0.5 (Gemma's);
  None: head_dim ** -0.5."""
  layer_types: tuple[LayerType, ...] | None = None
  """Each layer's attention, "full", "sliding", "chunked" (`attention_chunk_size`) or
  "linear" (gated DeltaNet, `linear_attention`) (one entry per layer); None: every layer
  "sliding" when `sliding_window` is set (Mistral), else "full"."""
  sliding_window: PositiveInt | None = None
  """Keys a query of a "sliding" layer sees, itself included (Hugging Face's
  `sliding_window`: key j is seen from query i when i - window < j <= i)."""
  local_rope_theta: PositiveFloat | None = None
  """RoPE base of the "sliding" layers, which then use no `rope_scaling` (Gemma 3's
  `rope_local_base_freq`); None: every layer uses `rope_theta`."""
  nope_layers: tuple[Annotated[int, pydantic.Field(ge=0)], ...] = ()
  """Layers whose attention turns no q and k by RoPE (NoPE: SmolLM3's every fourth)."""
  rotary_dim: PositiveInt | None = None
  """RoPE turns each head's first rotary_dim features (even), the rest pass as they are
  (Phi-4-mini's partial_rotary_factor 0.75); None: all head_dim of them."""
  o_proj_bias: bool = False
  """A bias on the attention's output projection (GPT-OSS's)."""
  attention_sinks: bool = False
  """A learned logit per query head (`attention.sinks`) that joins each softmax's
  denominator and weights no value, so a head can attend to nothing (GPT-OSS's sinks).
  Kernels that cannot take them are refused by the attention plan, with the reason."""
  attention_chunk_size: PositiveInt | None = None
  """Chunked local attention of the "chunked" layers (Llama 4's): a token at position p sees
  the positions C * (p // C) ... p of its chunk of C. Only the XLA kernels take it."""
  qk_l2_norm: bool = False
  """q and k divided by their RMS over each head (eps `norm_eps`, no weight) after RoPE, in
  the layers with RoPE (Llama 4's `use_qk_norm`)."""
  nope_temperature: tuple[PositiveFloat, PositiveFloat] | None = None
  """(floor_scale, attn_scale): the NoPE layers' queries at position p are multiplied by
  1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) (Llama 4's attention temperature)."""
  attention_output_gate: bool = False
  """q_proj also makes a gate per query feature, [q, gate] per head; the attention's output
  is multiplied by its sigmoid before o_proj (Qwen3-Next's gated attention)."""
  dtype: DType = "float32"
  """Compute dtype of activations and matmuls; logits are always float32. bfloat16
  pays on GPU and TPU; on CPU, XLA gives its matmuls float32 results plus converts,
  so it saves memory, not time (tiny Decoder, 2 quiet cores, jax 0.10.2: bf16 / f32
  step time 0.98, within the noise; torch.compile gains no more from bf16 autocast
  there: benchmarks/train_step.py --bf16 --torch)."""
  param_dtype: DType = "float32"
  """Storage dtype of the parameters."""
  remat: RematPolicy = "none"
  """Rematerialise each block in the backward pass: 'none', 'full' (keep
  nothing) or 'save_dots' (keep weight-matmul outputs, recompute the rest)."""
  scan_layers: bool = False
  """Stack the blocks' parameters (a leading 'layers' axis) and run them with
  `nnx.scan`: compile time stays flat in depth (MaxText's default). Off keeps one
  module per block (`layers/N/...`), the layout Hugging Face import/export, Qwix
  quantization and LoRA expect; `models.layer_stack` converts between the two.
  Flipping it on an existing workdir just works: a checkpoint of the other layout
  (parameters and optimizer moments) is converted bitwise on restore, and the next
  save is in the new one."""
  attention_impl: str = "auto"
  """Which attention kernels may run: 'auto' (the backend's preference), a name or a
  comma-separated list; resolved into the model's `kernels.AttentionPlan`."""

  @pydantic.model_validator(mode="before")
  @classmethod
  def _kind_defaults(cls, values: Any) -> Any:
    """Fills in the switches `kind` has on (`KIND_DEFAULTS`) where the input names none."""
    if isinstance(values, ArgsKwargs):
      kwargs = dict(values.kwargs or {})
      if not values.args and (defaults := KIND_DEFAULTS.get(kwargs.get("kind"))):
        return ArgsKwargs((), {**defaults, **kwargs})
      return values
    if isinstance(values, dict) and (defaults := KIND_DEFAULTS.get(values.get("kind"))):
      return {**defaults, **values}
    return values

  def __post_init__(self):
    names.parse(self.attention_impl, origin="model.attention_impl")
    self._check_switches()
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
      )
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must divide d_model={self.d_model} "
          "when head_dim is not set"
      )
    rotary = self.rotary_features
    if self.resolved_head_dim % 2 or rotary % 2 or rotary > self.resolved_head_dim:
      raise ValueError(f"head_dim={self.resolved_head_dim} must be even for RoPE, and "
                       f"rotary_dim={rotary} even and at most head_dim")
    scaling, half = self.rope_scaling, rotary // 2
    if scaling is not None and scaling.kind == "longrope" and (
        {len(scaling.short_factor), len(scaling.long_factor)} != {half}):
      raise ValueError(f"rope_scaling's short_factor and long_factor need rotary_dim / 2 = {half} "
                       f"entries each; got {len(scaling.short_factor)}, {len(scaling.long_factor)}")

  def _check_switches(self) -> None:
    """ValueError naming a switch this `kind` cannot express, or a window that does not fit."""
    fixed = KIND_DEFAULTS.get(self.kind, {})
    for name in SWITCHES:
      value, default = getattr(self, name), fixed.get(name, _SWITCH_DEFAULTS[name])
      if value != default and name not in KIND_FREE[self.kind]:
        able = [k for k, free in KIND_FREE.items()
                if name in free or KIND_DEFAULTS.get(k, {}).get(name) == value]
        raise ValueError(
            f"{name}={value!r} does not go with kind={self.kind!r}, whose layout has {name}="
            f"{default!r} (kinds that can have it: {', '.join(able) or 'none'})")
    if self.layer_types is not None and len(self.layer_types) != self.num_layers:
      raise ValueError(f"layer_types has {len(self.layer_types)} entries; num_layers="
                       f"{self.num_layers} needs one per layer")
    if "sliding" in self.resolved_layer_types and self.sliding_window is None:
      raise ValueError("layer_types names 'sliding' layers but sliding_window is not set")
    if "chunked" in self.resolved_layer_types and self.attention_chunk_size is None:
      raise ValueError("layer_types names 'chunked' layers but attention_chunk_size is not set")
    linear = "linear" in self.resolved_layer_types
    if linear != (self.linear_attention is not None) or (linear and self.kind not in
                                                         LINEAR_KINDS):
      raise ValueError(f"'linear' layers (layer_types) need model.linear_attention and kind "
                       f"{' or '.join(LINEAR_KINDS)}; got kind={self.kind!r}, "
                       f"linear_attention={self.linear_attention}")
    if (self.kind in MOE_KINDS) != (self.moe is not None):
      raise ValueError(f"kind={self.kind!r} " + (
          "is a mixture of experts: set model.moe (e.g. model.moe.num_experts=8)"
          if self.moe is None
          else f"has dense MLPs: model.moe needs kind {' or '.join(MOE_KINDS)}"))
    if self.moe is not None:
      wrong = [i for i in self.moe.dense_layers if i >= self.num_layers]
      if wrong:
        raise ValueError(f"moe.dense_layers names layer {wrong[0]}; the layers are 0.."
                         f"{self.num_layers - 1}")
      if self.scan_layers and len(set(self.moe_layers)) > 1:
        raise ValueError("scan_layers needs identical blocks; moe.dense_layers / moe.sparse_step "
                         "mix dense and MoE layers (set model.scan_layers=false)")
    if (self.kind in LATENT_KINDS) != (self.latent_attention is not None):
      raise ValueError(f"kind={self.kind!r} " + (
          "has latent attention: set model.latent_attention" if self.latent_attention is None
          else f"has grouped-query attention: model.latent_attention needs kind "
               f"{' or '.join(LATENT_KINDS)}"))
    latent = self.latent_attention
    if latent is not None and (self.resolved_head_dim, self.num_kv_heads) != (
        latent.qk_head_dim, self.num_heads):
      raise ValueError(f"latent attention's heads are num_heads={self.num_heads} of head_dim="
                       f"{latent.qk_head_dim} (qk_nope_head_dim + qk_rope_head_dim); got "
                       f"num_kv_heads={self.num_kv_heads}, head_dim={self.resolved_head_dim}")
    if wrong := [i for i in self.nope_layers if i >= self.num_layers]:
      raise ValueError(f"nope_layers names layer {wrong[0]}; the layers are 0.."
                       f"{self.num_layers - 1}")
    if self.scan_layers and 0 < len(set(self.nope_layers)) < self.num_layers:
      raise ValueError("scan_layers needs identical blocks; nope_layers mixes layers with and "
                       "without RoPE (set model.scan_layers=false)")
    if self.scan_layers and len(set(self.resolved_layer_types)) > 1:
      raise ValueError("scan_layers needs identical blocks; layer_types mixes full and sliding "
                       "layers (set model.scan_layers=false)")

  @property
  def moe_layers(self) -> tuple[bool, ...]:
    """Whether each layer's feed-forward is a mixture of experts."""
    moe = self.moe
    if moe is None:
      return (False,) * self.num_layers
    return tuple((i + 1) % moe.sparse_step == 0 and i not in moe.dense_layers
                 for i in range(self.num_layers))

  @property
  def expert_mlp_dim(self) -> int:
    """Hidden units of each expert (`moe.expert_mlp_dim`, else `mlp_dim`)."""
    return (self.moe.expert_mlp_dim if self.moe and self.moe.expert_mlp_dim
            else self.mlp_dim)

  @property
  def resolved_layer_types(self) -> tuple[str, ...]:
    """Each layer's attention: `layer_types`, or every layer as `sliding_window` implies."""
    if self.layer_types is not None:
      return tuple(self.layer_types)
    return ("sliding" if self.sliding_window is not None else "full",) * self.num_layers

  def local_window(self, layer: int) -> int | None:
    """The attention kernels' `local_window` of `layer` (keys i - w .. i); None: full."""
    if self.resolved_layer_types[layer] != "sliding":
      return None
    return self.sliding_window - 1

  def chunk_size(self, layer: int) -> int | None:
    """The attention kernels' `chunk_size` of `layer`; None: not a "chunked" layer."""
    chunked = self.resolved_layer_types[layer] == "chunked"
    return self.attention_chunk_size if chunked else None

  def rope(self, layer: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of `layer`'s RoPE: sliding layers use `local_rope_theta` if set."""
    if self.local_rope_theta is not None and self.resolved_layer_types[layer] == "sliding":
      return self.local_rope_theta, None
    return self.rope_theta, self.rope_scaling

  @property
  def attention_scale(self) -> float | None:
    """The attention logits' scale, query_pre_attn_scalar ** -0.5; None without one: the
    kernels' default, 1 / sqrt(head_dim), which stays out of their request."""
    if self.query_pre_attn_scalar is None:
      return None
    return float(self.query_pre_attn_scalar) ** -0.5

  @property
  def rotary_features(self) -> int:
    """The features of a head RoPE turns: latent attention's `qk_rope_head_dim`, else
    `rotary_dim`, else all `head_dim`."""
    if self.latent_attention is not None:
      return self.latent_attention.qk_rope_head_dim
    return self.rotary_dim or self.resolved_head_dim

  @property
  def padded_vocab_size(self) -> int:
    """Rows of the embedding and the output head: vocab_size up to a `vocab_multiple`."""
    return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

  @property
  def resolved_head_dim(self) -> int:
    """`head_dim`, or d_model // num_heads when it is not set."""
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  def num_params(self) -> int:
    """Parameter count, from the shapes alone (no arrays are built: `param_count`)."""
    from jax_ai_stack.recipes.models import param_count

    return param_count.num_params(self)

  def flops_per_token(self, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), as PaLM counts them for MFU
    (`param_count.flops_per_token`)."""
    from jax_ai_stack.recipes.models import param_count

    return param_count.flops_per_token(self, seq_len)

  @classmethod
  def tiny(cls, **overrides) -> DecoderConfig:
    """Trains in minutes on two CPU cores: 4 layers, d_model 128, ~0.8M params."""
    return cls(**overrides)

  @classmethod
  def small(cls, **overrides) -> DecoderConfig:
    """A laptop-GPU model: 6 layers, d_model 384, ~9.5M params."""
    fields = dict(
        num_layers=6, d_model=384, num_heads=6, num_kv_heads=2, mlp_dim=1024,
        max_seq_len=512,
    )
    return cls(**{**fields, **overrides})

  @classmethod
  def llama3_8b(cls, **overrides) -> DecoderConfig:
    """The shapes of Meta's Llama-3-8B (8.03B params); build it abstractly."""
    fields = dict(
        vocab_size=128_256, num_layers=32, d_model=4096, num_heads=32,
        num_kv_heads=8, mlp_dim=14_336, rope_theta=500_000.0, max_seq_len=8192,
        norm_eps=1e-5, tie_embeddings=False, dtype="bfloat16",
    )
    return cls(**{**fields, **overrides})


_SWITCH_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecoderConfig)
                    if f.name in SWITCHES}
