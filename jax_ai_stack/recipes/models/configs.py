"""The model configs: the shapes and numerics of each model, and nothing that runs.

Separate from the models so that a recipe config (which holds one of these)
loads, validates and prints without importing jax or flax; `llama` and `cnn`
build the models from them and re-export them.

Example:
  >>> LlamaConfig.small().num_params()
  9541632
  >>> CNNConfig(channels=(8, 8, 8)).flat_features
  8
"""

from __future__ import annotations

from typing import Annotated, Literal

import pydantic
from pydantic import PositiveFloat, PositiveInt

from jax_ai_stack.kernels import names
from jax_ai_stack.recipes.configlib import config_dataclass

DType = Literal["float32", "bfloat16", "float16"]
RematPolicy = Literal["none", "full", "save_dots"]


@config_dataclass
class RopeScaling:
  """Llama 3.1's RoPE frequency scaling (Hugging Face's rope_type "llama3").

  Stretches a model trained on `original_max_position_embeddings` tokens to a
  longer context: frequencies whose wavelength exceeds original / low_freq_factor
  are divided by `factor`, those under original / high_freq_factor are kept, and
  the ones between are blended smoothly. Llama 3.1 and 3.2 were trained with it,
  so their weights only give their logits with it. The defaults are Llama
  3.1's; Llama 3.2 uses factor 32.
  """

  kind: Literal["llama3"] = "llama3"
  """The scaling rule; "llama3" is the one implemented."""
  factor: PositiveFloat = 8.0
  """Divides the low (long-wavelength) frequencies."""
  low_freq_factor: PositiveFloat = 1.0
  """Wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
  high_freq_factor: PositiveFloat = 4.0
  """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
  original_max_position_embeddings: PositiveInt = 8192
  """The context length the model was pretrained on, before scaling."""

  def __post_init__(self):
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          f"high_freq_factor={self.high_freq_factor} must be greater than "
          f"low_freq_factor={self.low_freq_factor}"
      )


@config_dataclass
class LlamaConfig:
  """Shapes and numerics of a Llama-style decoder. The defaults are `tiny()`."""

  kind: Literal["llama"] = "llama"
  """Model family; tells model configs apart in a recipe."""
  vocab_size: PositiveInt = 259
  """Token ids are in [0, vocab_size). 259 = 256 bytes + BOS, EOS, PAD."""
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
  """Hidden units of the SwiGLU MLP."""
  rope_theta: PositiveFloat = 10_000.0
  """RoPE base frequency; larger values suit longer contexts (Llama 3: 500000)."""
  rope_scaling: RopeScaling | None = None
  """Llama 3.1 / 3.2's scaling of the RoPE frequencies (Hugging Face's
  rope_scaling with rope_type "llama3"), without which their weights give other
  logits; None is plain RoPE. import-hf sets it from config.json, export-hf
  writes it back; `model.rope_scaling.factor=32` sets it with Llama 3.1's other
  values."""
  max_seq_len: PositiveInt = 128
  """Longest sequence the recipes feed (training windows, prompt + generated)."""
  norm_eps: PositiveFloat = 1e-5
  """Epsilon of every RMSNorm."""
  tie_embeddings: bool = True
  """Compute logits with the embedding matrix instead of a separate head."""
  dtype: DType = "float32"
  """Compute dtype of activations and matmuls; logits are always float32. bfloat16
  pays on GPU and TPU; on CPU, XLA gives its matmuls float32 results plus converts,
  so it saves memory, not time (tiny Llama, 2 quiet cores, jax 0.10.2: bf16 / f32
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

  def __post_init__(self):
    names.parse(self.attention_impl, origin="model.attention_impl")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
      )
    if self.head_dim is None and self.d_model % self.num_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must divide d_model={self.d_model} "
          "when head_dim is not set"
      )
    if self.resolved_head_dim % 2:
      raise ValueError(f"head_dim={self.resolved_head_dim} must be even for RoPE")

  @property
  def resolved_head_dim(self) -> int:
    """`head_dim`, or d_model // num_heads when it is not set."""
    return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

  def num_params(self) -> int:
    """Parameter count, from the shapes alone (no arrays are built)."""
    embed = self.vocab_size * self.d_model
    blocks = self.num_layers * (self._block_matmul_params() + 2 * self.d_model)
    head = 0 if self.tie_embeddings else embed
    return embed + blocks + self.d_model + head  # + the final norm

  def flops_per_token(self, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), as PaLM counts them for MFU.

    6 per weight of every matmul (the output head is one, tied or not; the
    embedding lookup is not) plus 12 * layers * heads * head_dim * seq_len for
    the attention scores and their weighted sum, not halved for the causal mask.
    """
    matmul_weights = self.num_layers * self._block_matmul_params() + self.vocab_size * self.d_model
    attention = 12 * self.num_layers * self.num_heads * self.resolved_head_dim * seq_len
    return 6 * matmul_weights + attention

  def _block_matmul_params(self) -> int:
    d, h = self.d_model, self.resolved_head_dim
    return d * h * (2 * self.num_heads + 2 * self.num_kv_heads) + 3 * d * self.mlp_dim

  @classmethod
  def tiny(cls, **overrides) -> LlamaConfig:
    """Trains in minutes on two CPU cores: 4 layers, d_model 128, ~0.8M params."""
    return cls(**overrides)

  @classmethod
  def small(cls, **overrides) -> LlamaConfig:
    """A laptop-GPU model: 6 layers, d_model 384, ~9.5M params."""
    fields = dict(
        num_layers=6, d_model=384, num_heads=6, num_kv_heads=2, mlp_dim=1024,
        max_seq_len=512,
    )
    return cls(**{**fields, **overrides})

  @classmethod
  def llama3_8b(cls, **overrides) -> LlamaConfig:
    """The shapes of Meta's Llama-3-8B (8.03B params); build it abstractly."""
    fields = dict(
        vocab_size=128_256, num_layers=32, d_model=4096, num_heads=32,
        num_kv_heads=8, mlp_dim=14_336, rope_theta=500_000.0, max_seq_len=8192,
        norm_eps=1e-5, tie_embeddings=False, dtype="bfloat16",
    )
    return cls(**{**fields, **overrides})



@config_dataclass
class CNNConfig:
  """Shapes of the CNN classifier. The defaults fit 8x8 grey digits."""

  kind: Literal["cnn"] = "cnn"
  """Model family; tells model configs apart in a recipe."""
  num_classes: PositiveInt = 10
  """Number of classes, the width of the logits."""
  image_shape: tuple[PositiveInt, PositiveInt, PositiveInt] = (8, 8, 1)
  """(height, width, channels) of one input image."""
  channels: tuple[PositiveInt, ...] = (16, 32)
  """Output channels of each conv layer; each layer halves height and width."""
  kernel_size: PositiveInt = 3
  """Height and width of every conv kernel."""
  hidden: PositiveInt = 64
  """Units of the dense layer before the classifier."""
  dropout: Annotated[float, pydantic.Field(ge=0.0, lt=1.0)] = 0.1
  """Fraction of hidden units dropped in training mode."""
  dtype: DType = "float32"
  """Compute dtype; logits are always float32."""
  param_dtype: DType = "float32"
  """Storage dtype of the parameters."""

  def __post_init__(self):
    if not self.channels:
      raise ValueError("channels must name at least one conv layer; got ()")
    shrink = 2 ** len(self.channels)
    height, width, _ = self.image_shape
    if height % shrink or width % shrink:
      raise ValueError(
          f"image_shape={self.image_shape}: height and width must be divisible by "
          f"{shrink}, since each of the {len(self.channels)} conv layers in "
          f"channels={self.channels} halves them"
      )

  @property
  def flat_features(self) -> int:
    """Features after the last pool, fed to the dense layer."""
    height, width, _ = self.image_shape
    shrink = 2 ** len(self.channels)
    return (height // shrink) * (width // shrink) * self.channels[-1]

