"""The `model.rope_scaling` section: a RoPE frequency scaling, readable without jax
(`configs.DecoderConfig.rope_scaling`; `rope` computes it).

Example:
  >>> RopeScaling(factor=32.0).original_max_position_embeddings
  8192
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from jax_ai_stack.recipes.configlib import config_dataclass


@config_dataclass
class RopeScaling:
  """A RoPE frequency scaling: Llama 3.1's ("llama3"), plain division ("linear"), Phi-3's
  LongRoPE ("longrope") or YaRN ("yarn").

  "llama3" (Hugging Face's rope_type "llama3") stretches a model trained on
  `original_max_position_embeddings` tokens to a longer context: frequencies whose wavelength exceeds original / low_freq_factor
  are divided by `factor`, those under original / high_freq_factor are kept, and
  the ones between are blended smoothly. Llama 3.1 and 3.2 were trained with it,
  so their weights only give their logits with it. The defaults are Llama
  3.1's; Llama 3.2 uses factor 32.

  "longrope" (Phi-3's) divides frequency i by `short_factor[i]`, or by `long_factor[i]` in a
  row that reaches past original_max_position_embeddings (transformers decides per forward
  pass, here per row), and scales the sines and cosines by `attention_factor`.
  "yarn" (YaRN, GPT-OSS's; transformers' `_compute_yarn_parameters`): frequency i is
  1/theta^(2i/H) blended with it divided by `factor` by a ramp over i from the dimension
  that turns `beta_fast` times in `original_max_position_embeddings` to the one that turns
  `beta_slow` times (those bounds floored and ceiled with `truncate`), and sin and cos are
  multiplied by `attention_factor` (default 0.1 ln(factor) + 1; DeepSeek's `mscale` and
  `mscale_all_dim` change it, and latent attention's softmax scale).
  """

  kind: Literal["llama3", "linear", "longrope", "yarn"] = "llama3"
  """The scaling rule: "llama3", "linear" (every frequency divided by `factor`, Gemma 3's
  global layers; the other fields are then unused), "longrope" (the factors below) or
  "yarn" (`factor`, `original_max_position_embeddings` and the YaRN fields below)."""
  factor: PositiveFloat = 8.0
  """Divides the low (long-wavelength) frequencies; with "linear", all of them."""
  low_freq_factor: PositiveFloat = 1.0
  """Wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
  high_freq_factor: PositiveFloat = 4.0
  """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
  original_max_position_embeddings: PositiveInt = 8192
  """The context length the model was pretrained on, before scaling."""
  short_factor: tuple[PositiveFloat, ...] = ()
  """"longrope": each frequency's divisor (head_dim / 2 of them) in a row within
  original_max_position_embeddings."""
  long_factor: tuple[PositiveFloat, ...] = ()
  """"longrope": each frequency's divisor in a row that reaches past it."""
  beta_fast: PositiveFloat = 32.0
  """YaRN: rotations within the original context above which a frequency is kept."""
  beta_slow: PositiveFloat = 1.0
  """YaRN: rotations below which a frequency is divided by `factor`."""
  truncate: bool = True
  """YaRN: floor and ceil the ramp's bounds (GPT-OSS: false)."""
  attention_factor: PositiveFloat | None = None
  """"longrope" and "yarn": the factor on sin and cos (so on the logits, squared); None: the
  kind's default, YaRN's 0.1 ln(factor) + 1, LongRoPE's sqrt(1 + ln(factor) /
  ln(original_max_position_embeddings)) (1 where factor <= 1; import-hf writes it)."""
  mscale: NonNegativeFloat | None = None
  """YaRN (DeepSeek-V3's): with `mscale_all_dim`, the default `attention_factor` is
  mscale(mscale) / mscale(mscale_all_dim), where mscale(m) = 0.1 m ln(factor) + 1."""
  mscale_all_dim: NonNegativeFloat | None = None
  """YaRN (DeepSeek-V3's): latent attention's softmax scale is multiplied by
  mscale(mscale_all_dim)^2 (`softmax_factor`), as transformers' DeepSeek-V3 attention does."""

  def yarn_mscale(self, m: float) -> float:
    """YaRN's 0.1 m ln(factor) + 1 (1 where factor <= 1)."""
    return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

  @property
  def softmax_factor(self) -> float:
    """What latent attention multiplies its softmax scale by: mscale(mscale_all_dim)^2 of a
    YaRN scaling that sets it, else 1."""
    if self.kind != "yarn" or not self.mscale_all_dim:
      return 1.0
    return self.yarn_mscale(self.mscale_all_dim) ** 2

  def __post_init__(self):
    if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          f"high_freq_factor={self.high_freq_factor} must be greater than "
          f"low_freq_factor={self.low_freq_factor}"
      )
