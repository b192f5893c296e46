"""Attention kernels chosen per backend. `attention` is the one entry point.

`select` / `report` say which implementation runs for given shapes and why;
`autotune` / `load_autotune` pin a measured choice in a JSON file so that
training and resume use the same kernels.
"""

from jax_ai_stack.kernels.attention import attention
from jax_ai_stack.kernels.autotuning import (
    AUTOTUNE_FILENAME,
    AutotuneError,
    autotune,
    autotune_unsupported_reason,
    load_autotune,
)
from jax_ai_stack.kernels.registry import (
    AUTO,
    ENV_VAR,
    IMPLEMENTATIONS,
    PREFERENCE,
    Backend,
    Choice,
    NoImplementationError,
    parse_implementation,
    report,
    select,
)

__all__ = [
    "AUTO",
    "AUTOTUNE_FILENAME",
    "AutotuneError",
    "Backend",
    "Choice",
    "ENV_VAR",
    "IMPLEMENTATIONS",
    "NoImplementationError",
    "PREFERENCE",
    "attention",
    "autotune",
    "autotune_unsupported_reason",
    "load_autotune",
    "parse_implementation",
    "report",
    "select",
]
