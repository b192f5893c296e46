"""Generation: the engine that decodes many requests at once (`engine`), what a request
asks and what it produced (`requests`), the engine's compiled programs (`programs`),
sampling one token per row with each row's own settings (`sampling`), a request in one of
the engine's slots and the tokens it takes (`slots`), a request's grammar and the tokens it
allows (`grammar`), the pages of its KV cache and the prompt chunks kept for reuse
(`page_pool`), drafts checked ahead (`speculation`), a completion's text as its tokens
arrive, cut at stop strings (`text`), and the request files `generate` reads
(`request_file`).

Names load on first use.

Example:
  >>> from jax_ai_stack.recipes import inference
  >>> inference.Request((1, 2), max_tokens=4).temperature
  1.0
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("engine", "grammar", "page_pool", "programs", "request_file", "requests", "sampling",
               "slots", "speculation", "text")
_EXPORTS = {"Completion": "requests", "Engine": "engine", "Request": "requests",
            "RequestError": "requests", "Speculation": "speculation", "TextStream": "text",
            "sample": "sampling", "slot_length": "requests"}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
