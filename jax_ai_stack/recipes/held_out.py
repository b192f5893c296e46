"""A run's held-out metrics: the mean of each eval metric over its validation batches.

`train.eval_batches` batches of each validation split (a data mixture: each
component's, and their mean), through the run's jitted eval step; a run on
prompts (RL) is measured instead by the rewards of its policy's completions
(`rl.Rollouts.evaluate`). `Run.evaluate` calls it with its pieces.

Example:
  >>> with opened([1, 2]) as batches:
  ...   list(batches)
  [1, 2]
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jax_ai_stack.errors import ConfigError
from jax_ai_stack.recipes import step

Validation = Iterable | Mapping[str, Iterable] | None
"""A run's held-out data: one split, one per mixture component (by name), or None (off)."""


def evaluate(validation: Validation, *, eval_batches: int, measure: Callable[[Any], dict],
             evaluation: Callable[[dict], dict[str, float]], rollouts: Any = None,
             policy: Callable[[], Any] | None = None) -> dict[str, float]:
  """Mean metrics over the first `eval_batches` validation batches.

  Takes what it needs rather than the `Run` (which calls it), so the two modules form no
  circle. `measure(batch)`: one batch's metrics on the devices (the run's eval step on its
  state, the batch placed); `evaluation`: the Task's derived metrics from the means.
  A run on prompts (`rollouts`, `rl.Rollouts`) is measured instead by the rewards of the
  completions of `policy()`, the model that decodes as it stands.
  Several validation sets (a data mixture's components): each one's metrics
  as `eval_<name>_<metric>`, and their plain mean as `eval_<metric>`.
  """
  if validation is None:
    raise ConfigError("evaluation is off (train.eval_every=0): no validation split was built")
  if rollouts is not None:  # RL: the rewards of the policy's completions.
    with opened(validation) as batches:
      return rollouts.evaluate(policy(), batches, eval_batches)
  if not isinstance(validation, Mapping):
    return evaluation({f"eval_{k}": v
                       for k, v in _means(validation, eval_batches, measure).items()})
  each = {name: _means(dataset, eval_batches, measure) for name, dataset in validation.items()}
  mean = {k: sum(m[k] for m in each.values()) / len(each) for k in next(iter(each.values()))}
  return {**evaluation({f"eval_{k}": v for k, v in mean.items()}),
          **{f"eval_{name}_{k}": v for name, means in each.items() for k, v in means.items()}}


def _means(validation: Iterable, eval_batches: int,
           measure: Callable[[Any], dict]) -> dict[str, float]:
  """Mean metrics of the first `eval_batches` batches of one validation set."""
  totals: dict[str, float] = {}
  batches = 0
  with opened(validation) as iterator:
    for batch in iterator:
      if batches == eval_batches:
        break
      for k, v in step.host_metrics(measure(batch)).items():
        totals[k] = totals.get(k, 0.0) + v
      batches += 1
  if batches == 0:
    raise ConfigError(
        "the validation split has no full batch: lower data.batch_size, raise "
        "data.validation_fraction, or turn evaluation off with train.eval_every=0"
    )
  return {k: v / batches for k, v in totals.items() if k != "tokens"}


@contextlib.contextmanager
def opened(dataset: Iterable) -> Iterator:
  """`iter(dataset)`, closed on leaving: its prefetch thread stops now, not at garbage
  collection."""
  iterator = iter(dataset)
  try:
    yield iterator
  finally:
    if hasattr(iterator, "close"):
      iterator.close()
