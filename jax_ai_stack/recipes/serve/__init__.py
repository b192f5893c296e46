"""An OpenAI-compatible HTTP server over the generation engine: request bodies checked
into values (`openai_api`), the engine on a thread fed from the event loop (`worker`), and
the Starlette application and its uvicorn runner (`server`). Needs the `serve` extra
(starlette, uvicorn).

Names load on first use.

Example:
  >>> from jax_ai_stack.recipes import serve
  >>> serve.openai_api.MAX_STOPS
  4
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("cli", "guards", "openai_api", "replies", "server", "worker")
_EXPORTS = {"Served": "server", "build_app": "server", "serve": "server",
            "EngineWorker": "worker"}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
