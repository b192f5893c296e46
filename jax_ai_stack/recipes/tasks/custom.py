"""A model of your own: a Task from three functions, or found by import path.

The trainer, checkpoints, bitwise resume, meshes and the metrics log work for
any `nnx.Module`: what they need of a model is a Task. `CustomTask` makes one
from a model constructor, a loss and a Grain dataset; the config says
`model.kind: custom` (and `data.source: custom` when the data is yours too), so
the run's saved config is its own, with `model.settings` for your
hyperparameters. Naming the function that builds the Task in `model.task`
("module:name") lets the commands (`eval`, a resume, `--dry-run`) rebuild it.

Example: a linear model of y = 2x, trained through the stack's own steps.
  >>> import grain, numpy as np
  >>> from flax import nnx
  >>> from jax_ai_stack.recipes import config
  >>> cfg = config.load("none", overrides=["model.kind=custom", "data.source=custom"])
  >>> x = np.linspace(-1, 1, 64, dtype=np.float32)[:, None]
  >>> task = CustomTask(
  ...     cfg,
  ...     model=lambda rngs: nnx.Linear(1, 1, rngs=rngs),
  ...     loss=lambda model, batch: ((model(batch["x"]) - batch["y"]) ** 2).mean(),
  ...     dataset=lambda split, seed: grain.MapDataset.source(list(zip(x, 2 * x))).map(
  ...         lambda xy: {"x": xy[0], "y": xy[1]}).repeat().batch(8))
  >>> task.items_per_step, task.batch_axes()
  (8, {})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import jax
from flax import nnx

from jax_ai_stack import kernels
from jax_ai_stack.errors import ConfigError, UsageError
from jax_ai_stack.recipes import configlib, sharding
from jax_ai_stack.recipes.tasks.base import Batch, Task

ModelFn = Callable[[nnx.Rngs], nnx.Module]
LossFn = Callable[[nnx.Module, Batch], "jax.Array | tuple[jax.Array, dict[str, jax.Array]]"]
DatasetFn = Callable[[str, int], "grain.MapDataset | grain.IterDataset"]


class CustomTask(Task):
  """A Task from functions: your model, your loss, your data.

  Args:
    config: the recipe config (`model.kind: custom`; its `train`, `optim`,
      `checkpoint` and `mesh` sections drive the run, `data.batch_size` is the
      global batch unless `items_per_step` says otherwise).
    model: builds the model from `nnx.Rngs` (streams `params` and `dropout`,
      seeded by `train.seed`), e.g. `lambda rngs: MyModel(64, rngs=rngs)`.
    loss: `(model, batch) -> loss` or `(loss, {name: metric})`, a scalar to
      minimise; the metrics are logged (as `eval_<name>` in evaluations).
    dataset: `(split, seed) -> a Grain dataset of batches` (dicts of arrays):
      "train" endless and ordered by `seed`, "validation" one pass. Its
      iterator's position is saved with each checkpoint, so a resume reads on
      from the same batch. With several processes, each gets its own rows.
    batch_axes: logical axes of batch entries (see `Task.batch_axes`); default:
      every entry split along its first axis.
    items_per_step: what one step counts for the throughput; default
      `data.batch_size`.
    throughput_unit: what `items_per_step` counts ("examples", "tokens").
  """

  def __init__(self, config: Any, *, model: ModelFn, loss: LossFn, dataset: DatasetFn,
               batch_axes: dict[str, tuple[str | None, ...]] | None = None,
               items_per_step: int | None = None, throughput_unit: str = "examples"):
    super().__init__(config)
    self._model, self._loss, self._dataset = model, loss, dataset
    self._batch_axes = dict(batch_axes or {})
    self._items_per_step = items_per_step
    self.throughput_unit = throughput_unit

  @classmethod
  def for_config(cls, config: Any) -> Task:
    """The Task that `model.task` names, imported and called with `config`."""
    return imported_task(config)

  def build_model(self, seed: int, attention: kernels.AttentionPlan | None = None,
                  layout: sharding.Layout | None = None) -> nnx.Module:
    del attention, layout  # XLA places a model of one's own; it attends as it likes.
    return self._model(nnx.Rngs(params=seed, dropout=seed + 1))

  def loss(self, model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    out = self._loss(model, batch)
    return out if isinstance(out, tuple) else (out, {})

  def dataset(self, split: str, seed: int) -> grain.IterDataset:
    data = self._dataset(split, seed)
    if not isinstance(data, (grain.MapDataset, grain.IterDataset)):
      raise ConfigError(
          f"CustomTask's dataset({split!r}, seed) returned a {type(data).__name__}: it must "
          "return a grain.MapDataset or grain.IterDataset of batches, whose iterator "
          "position is saved with each checkpoint (a resume reads on from there)")
    return data

  @property
  def items_per_step(self) -> int:
    return self._items_per_step or super().items_per_step

  def batch_axes(self) -> dict[str, tuple[str | None, ...]]:
    return dict(self._batch_axes)


def imported_task(config: Any) -> Task:
  """`model.task` ("module:name") imported and called with `config`: the run's Task.

  The current directory is searched after `sys.path`, as `python -m` would,
  so `model.task=my_model:task` works from the folder holding my_model.py.

  Raises:
    UsageError: `model.task` is not set (the Task then comes from Python).
    ConfigError: it does not import, or does not return a Task.
  """
  path = config.model.task
  if path is None:
    raise UsageError(
        "this run trains a model of your own (model.kind=custom) and its config names no "
        "model.task: open it in Python with Trainer.open / Trainer.open_finished(workdir, "
        "task=...), or set model.task=module:function so the commands can import the Task")
  task = configlib.import_named(path, "model.task")(config)
  if not isinstance(task, Task):
    raise ConfigError(f"model.task={path!r} returned a {type(task).__name__}, not a "
                      "jax_ai_stack.recipes.tasks.Task")
  return task

