"""jax-ai-stack: a tested, pinned JAX AI stack plus small recipe builders.

Importing this package is cheap: JAX and the libraries load only when a
subpackage (``compat``, ``recipes``, ``kernels``) is first touched.
"""

from jax_ai_stack.lazy import lazy_attributes

__version__ = "0.1.0"

_SUBMODULES = (
    "absl_flags", "atomic", "cli", "compat", "determinism", "doctor", "errors", "kernels", "lazy",
    "logs", "native_logs", "recipes", "topology", "yamlio",
)
__all__ = ["__version__", *_SUBMODULES]
__getattr__ = lazy_attributes(__name__, _SUBMODULES)[0]


def __dir__():  # Also __version__, which is no lazy attribute.
  return sorted(__all__)
