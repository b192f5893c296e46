"""Generation: the engine that decodes many requests at once (`engine`), and sampling one
token per row with each row's own settings (`sampling`).

Names load on first use.

Example:
  >>> from jax_ai_stack.recipes import inference
  >>> inference.Request((1, 2), max_tokens=4).temperature
  1.0
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("engine", "sampling")
_EXPORTS = {"Completion": "engine", "Engine": "engine", "Request": "engine",
            "sample": "sampling"}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
