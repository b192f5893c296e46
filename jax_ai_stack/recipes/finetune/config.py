"""`FinetuneConfig`: the `finetune` section of a recipe (start from a trained run).

Kept out of `lora` (which imports jax, flax and qwix) so that a recipe config
loads and prints without them.

`finetune.base` alone fine-tunes every parameter from the base run's weights;
with `finetune.lora` only low-rank adapters train (Qwix LoRA) and the base
stays frozen, optionally quantized (QLoRA).

Example:
  >>> FinetuneConfig(base="runs/lm-tiny", lora=LoraConfig(rank=4)).lora.alpha
  8.0
"""

from __future__ import annotations

import re

from jax_ai_stack.recipes.configlib import config_dataclass
from jax_ai_stack.recipes.finetune.quant_config import check_scheme

WEIGHT_ONLY = ("w8", "w4")
"""The schemes of `finetune.quant` that quantize weights only: what a QLoRA base may use."""

DEFAULT_MODULES = "q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
"""The attention and MLP projections of the Llama model."""


@config_dataclass
class LoraConfig:
  rank: int = 8
  """Rank r of each adapter pair A [in, r] x B [r, out]; at most the layer's width."""
  alpha: float | None = None
  """Adapter scale is alpha / rank; None: 2 * rank (a scale of 2)."""
  modules: str = DEFAULT_MODULES
  """Layers that get adapters: a regex matching a module's whole path ('layers/0/mlp/up_proj')
  or its last name ('up_proj'); the default is every attention and MLP projection."""
  quantize_base: str | None = None
  """QLoRA: quantize the frozen base with this scheme of `finetune.quant` (w8 or w4); None: float."""

  def __post_init__(self):
    if self.rank < 1:
      raise ValueError(f"finetune.lora.rank must be >= 1, got {self.rank}")
    if self.alpha is None:
      object.__setattr__(self, "alpha", 2.0 * self.rank)
    if self.alpha <= 0:
      raise ValueError(f"finetune.lora.alpha must be > 0, got {self.alpha}")
    try:
      re.compile(self.modules)
    except re.error as e:
      raise ValueError(f"finetune.lora.modules: {self.modules!r} is not a regex: {e}") from None
    if self.quantize_base is not None:
      check_scheme(self.quantize_base)
      if self.quantize_base not in WEIGHT_ONLY:
        raise ValueError(f"finetune.lora.quantize_base={self.quantize_base!r} quantizes "
                         f"activations too: QLoRA takes a weight-only scheme ({', '.join(WEIGHT_ONLY)})")


@config_dataclass
class FinetuneConfig:
  base: str | None = None
  """A trained run to start from: its workdir (newest step) or one step directory
  (<workdir>/checkpoints/<step>). None: train from the seed."""
  lora: LoraConfig | None = None
  """Train low-rank adapters only (the base frozen); None: fine-tune every parameter."""

  def __post_init__(self):
    if self.lora is not None and self.base is None:
      raise ValueError("finetune.lora needs finetune.base: the trained run whose weights it adapts")

  @property
  def active(self) -> bool:
    return self.base is not None
