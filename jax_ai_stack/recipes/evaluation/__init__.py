"""Evaluation on the benchmarks people report: a run's model behind lm-evaluation-harness's
model interface (`harness_model`, its scoring requests laid out in rows by `rows`), and
harness tasks resolved and run on it (`harness`);
four tasks made from the standard library, offline (`stdlib_tasks`); tasks run at a
run's evaluations (`in_training`, `train.eval_tasks`); `jax-ai-stack eval --tasks` (`cli`).
Needs the `eval` extra (lm-eval).

Names load on first use.

Example:
  >>> from jax_ai_stack.recipes import evaluation
  >>> evaluation.harness.Tasks.__name__
  'Tasks'
"""

import importlib
import os

from jax_ai_stack.errors import MissingExtraError
from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("cli", "harness", "harness_model", "in_training", "rows", "stdlib_tasks")
_EXPORTS = {"HarnessModel": "harness_model", "evaluate": "harness"}
__all__ = ["harness_modules", *_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)


def harness_modules(what: str):
  """(`harness`, `harness_model`), the Hugging Face Hub switched off first (nothing is
  downloaded at run time); MissingExtraError naming `what` without the `eval` extra."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # Read when `datasets` is imported.
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  # lm-eval's bootstrap standard errors otherwise fork a pool of this process (jax's threads).
  os.environ.setdefault("DISABLE_MULTIPROC", "1")
  try:
    return (importlib.import_module(f"{__name__}.harness"),
            importlib.import_module(f"{__name__}.harness_model"))
  except ImportError as e:
    raise MissingExtraError(f"{what} needs the {e.name!r} package: pip install "
                            "'jax-ai-stack[eval]'") from None
