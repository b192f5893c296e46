"""tokamax's own flag on the command line: a fresh interpreter's argv is what absl reads.

argv: the command line's flags (e.g. --tokamax_autotuning_cache_miss_fallback=error)."""

from jax_ai_stack.kernels import implementations

implementations.import_tokamax()
from tokamax._src import config  # noqa: E402  (tokamax is imported the way the package does)

print(config.autotuning_cache_miss_fallback.value)
