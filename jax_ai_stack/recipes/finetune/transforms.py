"""The model transforms a recipe's `finetune` and `quant` sections ask for.

`for_config` is what `Task.model_transforms` gives by default: QAT's fake
quantization (`quant.Qat`), then a base run to start from, with or without
LoRA adapters (`lora.Finetune`). Each does nothing when its section is off.

Example:
  >>> from jax_ai_stack.recipes import config
  >>> chain = for_config(config.load("lm-tiny-lora"))
  >>> [type(t).__name__ for t in chain.transforms], chain.wrt.__name__
  (['Qat', 'Finetune', 'Teacher'], 'LoRAParam')
"""

from __future__ import annotations

from typing import Any

from jax_ai_stack.recipes.finetune import lora, quant, teacher
from jax_ai_stack.recipes.transforms import Chain

__all__ = ["for_config"]


def for_config(recipe: Any) -> Chain:
  """QAT (`quant.qat`), the base and adapters (`finetune`), then a distillation teacher
  (`finetune.distill.teacher`) of `recipe`."""
  return Chain([quant.Qat(recipe), lora.Finetune.of(recipe), teacher.Teacher.of(recipe)])
