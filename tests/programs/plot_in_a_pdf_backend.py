"""A plot after choosing the pdf backend: a fresh interpreter, whose matplotlib nothing touched.

argv: the workdir."""

import sys

import matplotlib

matplotlib.use("pdf")
from jax_ai_stack.recipes import metrics  # noqa: E402  (after the backend is chosen)

metrics.plot(sys.argv[1])
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
