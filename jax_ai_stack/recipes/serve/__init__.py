"""An OpenAI-compatible HTTP server over the generation engine: request bodies checked
into values (`openai_api`) or refused (`api_error`), tool calls offered and read
(`tools`), the engine on a thread fed from the event loop (`worker`), the replies built
(`replies`), and the Starlette application and its uvicorn runner (`server`). Needs the
`serve` extra (starlette, uvicorn).

Names load on first use.

Example:
  >>> from jax_ai_stack.recipes import serve
  >>> serve.openai_api.MAX_STOPS
  4
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("api_error", "cli", "guards", "openai_api", "replies", "server", "tools",
               "worker")
_EXPORTS = {"Served": "server", "build_app": "server", "serve": "server",
            "EngineWorker": "worker"}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
