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

from jax_ai_stack.lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, (), renamed={
    "Llama": "jax_ai_stack.recipes.models.Decoder",
    "LlamaConfig": "jax_ai_stack.recipes.models.DecoderConfig"})
