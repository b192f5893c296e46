"""Evaluation on the benchmarks people report: a run's model behind lm-evaluation-harness's
model interface (`harness_model`), and harness tasks resolved and run on it (`harness`);
four tasks made from the standard library, offline (`stdlib_tasks`); tasks run at a
run's evaluations (`in_training`, `train.eval_tasks`). Needs the `eval` extra (lm-eval).

Names load on first use.

Example:
  >>> from jax_ai_stack.recipes import evaluation
  >>> evaluation.harness.Tasks.__name__
  'Tasks'
"""

from jax_ai_stack.lazy import lazy_attributes

_SUBMODULES = ("harness", "harness_model", "in_training", "stdlib_tasks")
_EXPORTS = {"HarnessModel": "harness_model", "evaluate": "harness"}
__all__ = [*_SUBMODULES, *_EXPORTS]
__getattr__, __dir__ = lazy_attributes(__name__, _SUBMODULES, _EXPORTS)
