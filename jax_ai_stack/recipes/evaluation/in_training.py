"""lm-evaluation-harness tasks measured during training (`train.eval_tasks`).

At an evaluation step where they are due (every `train.eval_tasks_every` steps, by
default at every evaluation, and at the last step), `measure` runs the tasks on the
model as it stands; the Trainer logs their metrics, as eval_harness_<task>_<metric>,
with the step's held-out ones (metrics.jsonl, TensorBoard, the plot, the run record).
A resumed run logs each once: an evaluation whose step was not saved is cut from the
log with the rest of that attempt and runs again.

On several processes every process takes a whole copy of the model on its first
device (`sharding.on_this_process`, gathered together), process 0 runs the harness on
its copy alone and the others wait for its metrics, broadcast at the end: no
collective inside the harness (Levanter instead broadcasts each batch of requests
from process 0 for the others to compute their shards).

Example:
  >>> from jax_ai_stack.recipes import config
  >>> TrainingTasks.of(config.load("lm-tiny").train) is None  # No train.eval_tasks.
  True
  >>> metric_names({"results": {"stdlib_definitions": {"alias": "stdlib_definitions",
  ...                                                  "acc,none": 0.8, "acc_stderr,none": "N/A"}}})
  {'eval_harness_stdlib_definitions_acc': 0.8}
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_ai_stack.recipes import distributed, evaluation, sharding

PREFIX = "eval_harness_"
BATCH_SIZE = 8
"""Rows of the harness's scoring and generation batches."""


class TrainingTasks:
  """The harness tasks a run measures at its evaluations (see the module)."""

  def __init__(self, train_config):
    """Resolves `train_config.eval_tasks` now (ConfigError naming a bad one, before any
    step); 'stdlib' is made into a scratch directory kept while this object lives."""
    self.train = train_config
    self._harness, self._harness_model = evaluation.harness_modules("train.eval_tasks")
    self._scratch = tempfile.TemporaryDirectory(prefix="jax-ai-stack-tasks-")
    self.tasks, _ = self._harness.prepare(list(train_config.eval_tasks),
                                          pathlib.Path(self._scratch.name),
                                          what="train.eval_tasks")

  @classmethod
  def of(cls, train_config) -> TrainingTasks | None:
    """The run's tasks; None without `train.eval_tasks`."""
    return cls(train_config) if train_config.eval_tasks else None

  def due(self, step: int) -> bool:
    """Whether the evaluation at `step` runs the tasks too."""
    every = self.train.eval_tasks_every or self.train.eval_every
    return step % every == 0 or step == self.train.steps

  def measure(self, run) -> dict[str, float]:
    """The tasks' metrics on `run`'s model as it stands (its state merged by the caller)."""
    scoring = sharding.on_this_process(run.model)
    generating = sharding.on_this_process(run.inference_model())
    metrics = {}
    if distributed.is_primary():
      model = self._harness_model.for_run(run, batch_size=BATCH_SIZE, scoring=scoring,
                                          generating=generating)
      with run.kernel_configs():
        results = self._harness.evaluate(model, self.tasks, limit=self.train.eval_tasks_limit,
                                         seed=self.train.seed, bootstrap_iters=0)  # Unlogged.
      metrics = metric_names(results)
    return _from_process_0(metrics)


def metric_names(results: dict[str, Any]) -> dict[str, float]:
  """The harness's results as {eval_harness_<task>_<metric>: value}: numbers only, no
  standard errors, the default filter's name ("none") left out."""
  metrics = {}
  for task, values in results["results"].items():
    for key, value in values.items():
      name, _, kind = key.partition(",")
      if name.endswith("_stderr") or isinstance(value, bool) or not isinstance(
          value, (int, float)):
        continue
      suffix = name if kind in ("", "none") else f"{name}_{kind}"
      metrics[f"{PREFIX}{task}_{suffix}"] = float(value)
  return metrics


def _from_process_0(metrics: dict[str, float]) -> dict[str, float]:
  """Process 0's `metrics` on every process (as given on one)."""
  if jax.process_count() == 1:
    return metrics
  data = np.frombuffer(json.dumps(metrics).encode(), np.uint8)
  size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
  padded = np.zeros(size, np.uint8)
  if distributed.is_primary():
    padded[:] = data
  received = np.asarray(multihost_utils.broadcast_one_to_all(padded), np.uint8)
  return json.loads(received.tobytes().decode())
