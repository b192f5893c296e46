"""The decoder's first names, kept for one release: `Llama` is `decoder.Decoder`,
`LlamaConfig` is `configs.DecoderConfig`. Each warns (DeprecationWarning) when imported.

Example:
  >>> import warnings
  >>> from jax_ai_stack.recipes.models import llama
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   llama.Llama.__name__, str(caught[0].message)
  ('Decoder', 'jax_ai_stack.recipes.models.llama.Llama is deprecated: use jax_ai_stack.recipes.models.Decoder')
"""

from __future__ import annotations

import warnings

_RENAMED = {"Llama": "Decoder", "LlamaConfig": "DecoderConfig"}


def __getattr__(name: str):
  if name not in _RENAMED:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  new = _RENAMED[name]
  warnings.warn(f"{__name__}.{name} is deprecated: use jax_ai_stack.recipes.models.{new}",
                DeprecationWarning, stacklevel=2)
  from jax_ai_stack.recipes import models  # pylint: disable=g-import-not-at-top
  return getattr(models, new)
