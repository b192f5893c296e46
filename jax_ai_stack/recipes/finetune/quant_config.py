"""`QuantConfig`: the `quant` section of a recipe, and the names of the schemes.

Kept out of `quant` (which imports Qwix and jax) so that a recipe config loads
and prints without them, and so that any module can check a scheme name
cheaply; `quant` re-exports everything here.

Example:
  >>> QuantConfig(qat="w8a8").qat
  'w8a8'
  >>> try:
  ...   check_scheme("int3")
  ... except SchemeError as e:
  ...   print(str(e)[:60])
  unknown quantization scheme 'int3'; schemes: w8 (int8 weight
"""

from __future__ import annotations

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes.configlib import config_dataclass

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
