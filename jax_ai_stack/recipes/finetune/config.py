"""The `finetune` and `quant` sections of a recipe, and the names of the quantization schemes.

Kept out of `lora`, `quant` and `ptq` (which import jax, Flax and Qwix) so
that a recipe config loads and prints without them, and so that any module
can check a scheme name cheaply; `quant` re-exports the scheme names.

`finetune.base` alone fine-tunes every parameter from the base run's weights;
with `finetune.lora` only low-rank adapters train (Qwix LoRA) and the base
stays frozen, optionally quantized (QLoRA). `quant.qat` trains through the
fake quantization of a scheme (QAT).

Example:
  >>> FinetuneConfig(base="runs/lm-tiny", lora=LoraConfig(rank=4)).lora.alpha
  8.0
  >>> QuantConfig(qat="w8a8").qat
  'w8a8'
  >>> try:
  ...   check_scheme("int3")
  ... except SchemeError as e:
  ...   print(str(e)[:60])
  unknown quantization scheme 'int3'; schemes: w8 (int8 weight
"""

from __future__ import annotations

import dataclasses

import re

from jax_ai_stack.errors import ConfigError
from typing import Literal

from jax_ai_stack.recipes.configlib import config_dataclass
from jax_ai_stack.recipes.models.configs import DECODER_PROJECTIONS

SCHEMES: dict[str, str] = {
    "w8": "int8 weights",
    "w8a8": "int8 weights and activations",
    "w4": "int4 MLP weights, int8 elsewhere",
}
"""Every quantization scheme, by name, with what it quantizes (`quant.rules` builds them)."""


class SchemeError(ConfigError):
  """A quantization scheme name that is not in `SCHEMES`; the message lists them."""


def describe_schemes() -> str:
  return ", ".join(f"{name} ({what})" for name, what in SCHEMES.items())


def check_scheme(name: str) -> str:
  """`name` if it is a scheme; else `SchemeError` listing the schemes."""
  if name not in SCHEMES:
    raise SchemeError(f"unknown quantization scheme {name!r}; schemes: {describe_schemes()}")
  return name


@config_dataclass
class QuantConfig:
  """Quantization-aware training (the `quant` section)."""

  qat: str | None = None
  """Train through Qwix's fake quantization for this scheme (w8, w8a8, w4), so that
  `jax-ai-stack quantize` loses less; None: train in float."""

  def __post_init__(self):
    if self.qat is not None:
      check_scheme(self.qat)


WEIGHT_ONLY = ("w8", "w4")


def experts_refuse(scheme: str, kind: str) -> str | None:
  """Why a mixture-of-experts model of `kind` cannot take `scheme`, or None: its experts
  (`models.expert_quant`) quantize weights, not activations."""
  from jax_ai_stack.recipes.models.configs import MOE_KINDS

  if kind not in MOE_KINDS or scheme in WEIGHT_ONLY:
    return None
  return (f"quantization scheme {scheme!r} quantizes activations, which the experts of a "
          f"mixture-of-experts model (model.kind={kind!r}) do not take: their weights are "
          f"quantized alone; use {' or '.join(WEIGHT_ONLY)}")
"""The schemes of `finetune.quant` that quantize weights only: what a QLoRA base may use."""

DEFAULT_MODULES: str = DECODER_PROJECTIONS
"""The layers LoRA adapts by default: the decoder's attention and MLP projections (the
model's own, `models.configs`)."""


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
class DpoConfig:
  """Direct preference optimization (`finetune.dpo`): what a run on preference data minimizes."""

  beta: float = 0.1
  """How far from the reference the model may move: the scale of the log-ratio margin."""
  loss: Literal["sigmoid", "ipo"] = "sigmoid"
  """sigmoid: DPO's -log sigmoid(beta margin); ipo: (margin - 1/(2 beta))^2."""
  label_smoothing: float = 0.0
  """sigmoid: the share of pairs assumed mislabelled (conservative DPO); 0: plain DPO."""

  def __post_init__(self):
    if self.beta <= 0:
      raise ValueError(f"finetune.dpo.beta must be > 0, got {self.beta}")
    if not 0 <= self.label_smoothing < 0.5:
      raise ValueError(f"finetune.dpo.label_smoothing must be in [0, 0.5), got "
                       f"{self.label_smoothing}")


@config_dataclass
class DistillConfig:
  """Distillation from a teacher (`finetune.distill`): the student learns the teacher's
  distribution over each next token of the run's data, not only the token itself; on
  prompts, of the completions it samples itself (on-policy)."""

  teacher: str | None = None
  """A trained run whose model teaches (its workdir, newest step, or one step directory),
  or a Hugging Face directory, with the run's tokenizer and vocabulary; frozen, never
  saved. None: no distillation."""
  loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
  """forward_kl: KL(teacher || student) (Hinton's KD: the student covers what the teacher
  allows); reverse_kl: KL(student || teacher) (MiniLLM: mode-seeking); jsd: GKD's
  generalized Jensen-Shannon divergence at `beta`."""
  beta: float = 0.5
  """jsd: the teacher's share of the mixture both are compared with, in (0, 1) (0 would be
  forward_kl, 1 reverse_kl, as TRL's GKD has them)."""
  temperature: float = 1.0
  """Both models' logits are divided by it; the divergence is scaled by its square, so the
  gradient keeps its size (Hinton et al.)."""
  next_token_weight: float = 0.0
  """The share of the loss that is the next token's cross-entropy on the data; the rest is
  the divergence."""

  def __post_init__(self):
    if self.loss == "jsd" and not 0 < self.beta < 1:
      raise ValueError(f"finetune.distill.beta must be in (0, 1) for loss jsd, got {self.beta} "
                       "(0 is loss forward_kl, 1 reverse_kl)")
    if self.temperature <= 0:
      raise ValueError(f"finetune.distill.temperature must be > 0, got {self.temperature}")
    if not 0 <= self.next_token_weight < 1:
      raise ValueError("finetune.distill.next_token_weight must be in [0, 1), got "
                       f"{self.next_token_weight}")


@config_dataclass
class FinetuneConfig:
  base: str | None = None
  """A trained run to start from: its workdir (newest step) or one step directory
  (<workdir>/checkpoints/<step>). None: train from the seed."""
  lora: LoraConfig | None = None
  """Train low-rank adapters only (the base frozen); None: fine-tune every parameter."""
  dpo: DpoConfig = dataclasses.field(default_factory=DpoConfig)
  """The DPO loss, for a run on preference data (`data.source: preference`)."""
  distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
  """Learn from a teacher's distribution (`distill.teacher`), on text or chat data."""

  def __post_init__(self):
    if self.lora is not None and self.base is None:
      raise ValueError("finetune.lora needs finetune.base: the trained run whose weights it adapts")

  @property
  def active(self) -> bool:
    return self.base is not None
