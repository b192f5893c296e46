"""A run's held-out metrics: the mean of each eval metric over its validation batches.

`train.eval_batches` batches of each validation split (a data mixture: each
component's, and their mean), through the run's jitted eval step; a run on
prompts (RL) is measured instead by the rewards of its policy's completions
(`rl.Rollouts.evaluate`). `Run.evaluate` calls it.

Example:
  >>> with opened([1, 2]) as batches:
  ...   list(batches)
  [1, 2]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import grain

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import step

if TYPE_CHECKING:
  from jax_ai_stack.recipes.run import Run


def evaluate(run: Run) -> dict[str, float]:
  """Mean metrics over the first `train.eval_batches` validation batches.

  Several validation sets (a data mixture's components): each one's metrics
  as `eval_<name>_<metric>`, and their plain mean as `eval_<metric>`.
  """
  if run.validation is None:
    raise ConfigError("evaluation is off (train.eval_every=0): no validation split was built")
  if run.task.rollouts is not None:  # RL: the rewards of the policy's completions.
    step.merge(run.model, run.optimizer, run.state)  # The policy as it stands.
    with opened(run.validation) as batches:
      return run.task.rollouts.evaluate(run.inference_model(), batches,
                                         run.config.train.eval_batches)
  if not isinstance(run.validation, Mapping):
    return run.task.evaluation({f"eval_{k}": v for k, v in _means(run, run.validation).items()})
  each = {name: _means(run, dataset) for name, dataset in run.validation.items()}
  mean = {k: sum(m[k] for m in each.values()) / len(each) for k in next(iter(each.values()))}
  return {**run.task.evaluation({f"eval_{k}": v for k, v in mean.items()}),
          **{f"eval_{name}_{k}": v for name, means in each.items() for k, v in means.items()}}


def _means(run: Run, validation: grain.IterDataset) -> dict[str, float]:
  """Mean metrics of the first `train.eval_batches` batches of one validation set."""
  totals: dict[str, float] = {}
  batches = 0
  with opened(validation) as iterator:
    for batch in iterator:
      if batches == run.config.train.eval_batches:
        break
      metrics = run.eval_step(run.state, run.placement.batch(batch))
      for k, v in step.host_metrics(metrics).items():
        totals[k] = totals.get(k, 0.0) + v
      batches += 1
  if batches == 0:
    raise ConfigError(
        "the validation split has no full batch: lower data.batch_size, raise "
        "data.validation_fraction, or turn evaluation off with train.eval_every=0"
    )
  return {k: v / batches for k, v in totals.items() if k != "tokens"}


@contextlib.contextmanager
def opened(dataset: grain.IterDataset) -> Iterator:
  """`iter(dataset)`, closed on leaving: its prefetch thread stops now, not at garbage
  collection."""
  iterator = iter(dataset)
  try:
    yield iterator
  finally:
    if hasattr(iterator, "close"):
      iterator.close()
